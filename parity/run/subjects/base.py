"""The subject protocol, the loader for ``package.module:factory``, and the runner both hosts share.

A subject is anything with these attributes (subclassing :class:`Subject` is optional)::

    name: str                       # short name, for messages (default: the spec)
    args: dict                      # JSON-safe; factory(**args) re-creates the subject
    impls: tuple[str, ...]          # optional; implementations build() accepts
    reference_impl: str             # optional; the impl used for high-precision references
                                    #   (default "reference")
    make_inputs() -> dict[str, Tensor] | Inputs
                                    # on the CPU, deterministic: seeded torch.Generator from args
    make_state() -> dict[str, Tensor] | None
                                    # optional; weights and buffers, deterministic on the CPU.
                                    #   Without it, the state_dict of the module built on the
                                    #   capture host is stored.
    build(impl: str) -> nn.Module   # on the CPU; every impl has the same state_dict keys
    build(impl: str, device) -> nn.Module
                                    # or, taking ``device``: built there (the target device, or
                                    #   ``meta`` for a module that is then given its tensors), so
                                    #   no copy of the weights passes through the host
    call(module, inputs: Inputs) -> Any
                                    # optional; runs the module (default: module(**inputs.tensors))
    check_inputs(inputs: Inputs)    # optional; raise UsageError for inputs this subject cannot
                                    #   run (the compare host's inputs come from a bundle)
    check_state(state: dict)        # optional; the same for stored state
    place(module, device) -> nn.Module
                                    # optional; puts the module on its devices (manual pipeline
                                    #   stages, or a Hugging Face device_map model returned as it
                                    #   is); default: module.to(device)
    parallelize(module, mesh) -> plan | None
                                    # optional; splits the module over a 1-D DeviceMesh under
                                    #   torchrun and returns the parallelize_module plan it applied
                                    #   (parity.distributed.capture)
    memory_needs() -> list[(str, int)]
                                    # optional; estimated bytes per purpose, checked against the
                                    #   device's memory before a non-CPU build (``sizes_text``,
                                    #   optional, names the arguments behind it in the message)

The harness, never the subject, loads the stored state into the module, moves module and inputs
to the device, and casts to a higher precision for reference runs (:class:`SubjectRunner`). So
the compare host builds the module from the bundle's inputs and state, never from a seed. State
may be a :class:`StateSource`, read one tensor at a time as it is loaded (a bundle's, or a
checkpoint's), so the host never holds a second full copy of the weights.

Trust. A bundle is data: its manifest names a subject spec, and importing that spec would run
whatever code it names. :func:`runner_from_manifest` therefore builds only subjects this host
trusts (:func:`check_trusted`): the built-ins (and aliases registered by code on this host), a
spec the user named (``compare --subject``, or ``trusted=`` from the caller), the ``trust = [...]``
list of the user's tolerance file or ``[tool.parity]``, and specs trusted with
:func:`trust_subject`. The check comes before anything is imported. A module inside the bundle
directory is never imported as a subject, and the bundle directory is taken off ``sys.path``.

Errors. Anything a subject's own code raises (factory, make_inputs, make_state, build, forward)
becomes a :class:`~parity.base.errors.SubjectError` (exit status 3) naming the stage, except parity's
own UsageErrors (exit 2), which pass through: the built-ins validate their arguments, inputs and
state that way, so a bad manifest is exit 2, never a KeyError from deep inside a forward.

Long because the protocol's documentation (above), the loader, the trust rule and the runner are
one contract that a subject's author reads together; the built-in subjects live beside it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.machinery
import inspect
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parity.base import dtypes
from parity.base.errors import ParityError, SubjectError, UsageError
from parity.base.prefetch import read_ahead
from parity.base.text import did_you_mean, printable
from parity.run.subjects.loading import UnresolvedModule, module_locations

# Short name -> torch dtype for the floating dtypes a subject may use (parity.base.dtypes' names).
DTYPES: dict[str, torch.dtype] = {name: dtypes.torch_dtype(name) for name in dtypes.FLOATING}


def check_ints(what: str, values: Mapping[str, Any], minimum: int) -> None:
    """Raise a UsageError naming the first of ``values`` that is not an integer >= ``minimum``
    (1: "a positive integer", 0: "a non-negative integer"); bools are not integers here."""
    bound = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise UsageError(f"{what} {name} must be {bound}, got {shown(value)}")


def shown(value: Any) -> str:
    """``repr(value)`` for a message: escaped and cut (a manifest may hold a megabyte string)."""
    try:
        text = repr(value)
    except ValueError:  # an int with more digits than Python will print
        text = f"an integer of about {value.bit_length() * 0.30103:.0f} digits"
    return printable(text, limit=80)


def check_inputs_tensor(inputs: "Inputs", name: str, where: str, *, shape: tuple[int, ...] | None = None,
                        floating: bool | None = None) -> torch.Tensor:
    """The input tensor ``name``, or a UsageError naming ``where`` and what is wrong with it (for a
    subject's ``check_inputs``: a bundle's inputs are data and may be missing or malformed)."""
    tensor = inputs.tensors.get(name) if isinstance(inputs.tensors, dict) else None
    if tensor is None:
        raise UsageError(f"{where}: input {printable(name)!r} is missing")
    if not isinstance(tensor, torch.Tensor):
        raise UsageError(f"{where}: input {printable(name)!r} is a {type(tensor).__name__}, not a tensor")
    if floating is True and not tensor.is_floating_point():
        raise UsageError(f"{where}: input {printable(name)!r} must be a floating tensor, got {tensor.dtype}")
    if floating is False and (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool):
        raise UsageError(f"{where}: input {printable(name)!r} must be an integer tensor, got {tensor.dtype}")
    if shape is not None and tuple(tensor.shape) != tuple(shape):
        raise UsageError(f"{where}: input {printable(name)!r} has shape {list(tensor.shape)}, expected {list(shape)}")
    return tensor


def parse_dtype(label: str) -> torch.dtype:
    """``"bf16"`` (or ``"bfloat16"``) -> ``torch.bfloat16``; a UsageError names the bad value."""
    return dtypes.torch_dtype(label)


@dataclasses.dataclass
class Inputs:
    """A subject's inputs: named tensors (stored in the bundle) and JSON-safe metadata (in the manifest)."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of_bundle(cls, bundle) -> "Inputs":
        """The inputs stored in a :class:`parity.bundle.reader.BundleReader` (tensors and ``inputs_meta``)."""
        return cls(bundle.tensors("input"), bundle.inputs_meta)

    def to(self, device: torch.device | str, float_dtype: torch.dtype | None = None) -> "Inputs":
        """Move every tensor to ``device``; with ``float_dtype``, cast floating tensors to it."""
        moved = {}
        for name, tensor in self.tensors.items():
            if float_dtype is not None and tensor.is_floating_point():
                moved[name] = tensor.to(device=device, dtype=float_dtype)
            else:
                moved[name] = tensor.to(device)
        return Inputs(moved, self.meta)


# What one load_state_dict call reads of a StateSource at most: bounded host memory, few calls.
STATE_CHUNK_BYTES = 256 * 2**20
# What is read ahead of the chunk being loaded, at most: the host (and, with a GPU, the device)
# holds at most the chunk plus this beyond the module while its state is read.
STATE_READ_AHEAD_BYTES = 256 * 2**20


def staged_state_bytes(sizes: Iterable[int]) -> int:
    """The most a StateSource with tensors of ``sizes`` bytes holds on the module's device beyond
    the module while :meth:`SubjectRunner.load_state` loads it: the chunk being loaded (up to
    STATE_CHUNK_BYTES, or one tensor larger than that) plus what is read ahead of it (up to
    STATE_READ_AHEAD_BYTES, or one tensor larger than that; :func:`parity.base.prefetch.read_ahead`)."""
    largest = max(sizes, default=0)
    return max(STATE_CHUNK_BYTES, largest) + max(STATE_READ_AHEAD_BYTES, largest)


class StateSource(Mapping):
    """State tensors read one at a time, when asked for (``load(name)``), never all at once.

    ``meta``: name -> (shape, dtype) of every tensor, known without reading it. What the harness
    loads into a module it reads in bounded chunks (:meth:`SubjectRunner.load_state`), so with a
    bundle's or a checkpoint's state the host holds the module plus about two chunks, not two models.
    """

    def __init__(self, meta: Mapping[str, tuple[tuple[int, ...], torch.dtype]], load: Callable[[str], torch.Tensor],
                 *, load_to: Callable[[str, torch.device, Any], torch.Tensor] | None = None):
        self.meta = dict(meta)
        self._load = load
        # Reads a tensor onto a device itself (through page-locked pieces), given the stream that
        # will use it (which waits for the copies); None: ``load``'s host tensor is copied there.
        self._load_to = load_to
        # wall time of stream() (the first read to the last tensor handed over), plus the copy of the
        # last chunk into the module (``SubjectRunner.load_state``)
        self.stream_seconds = 0.0
        self.stream_bytes = 0  # bytes it handed over

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.meta:
            raise KeyError(name)
        return self._load(name)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self.meta

    def __iter__(self) -> Iterator[str]:
        return iter(self.meta)

    def __len__(self) -> int:
        return len(self.meta)

    def nbytes(self, name: str) -> int:
        shape, dtype = self.meta[name]
        count = 1
        for dim in shape:
            count *= dim
        return count * torch.empty(0, dtype=dtype).element_size()

    def _fetch(self, name: str, device: torch.device | None, stream: Any) -> torch.Tensor:
        if device is None or device.type == "cpu":
            return self._load(name)
        if self._load_to is not None:
            return self._load_to(name, device, stream)
        return self._load(name).to(device)

    def stream(self, names: Iterable[str], *, device: torch.device | str | None = None,
               max_bytes: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` in the order of ``names``, read ahead on background threads
        (:func:`parity.base.prefetch.read_ahead`; at most ``max_bytes``, default
        ``STATE_READ_AHEAD_BYTES``, read and not yet handed over), on ``device`` (copied there by
        the reading threads, through page-locked pieces where the source reads them so). The
        reads, checksums and copies of the next tensors overlap what the caller does with this one."""
        target = None if device is None else torch.device(device)
        # The reading threads copy on a side stream; the stream of the thread that uses the
        # tensors (this one's, now) waits for those copies.
        consumer = torch.cuda.current_stream(target) if target is not None and target.type == "cuda" else None
        started = time.monotonic()
        try:
            for name, tensor in read_ahead(list(names), lambda name: self._fetch(name, target, consumer), self.nbytes,
                                           max_bytes=STATE_READ_AHEAD_BYTES if max_bytes is None else max_bytes,
                                           name="parity-state"):
                self.stream_bytes += self.nbytes(name)
                yield name, tensor
        finally:
            self.stream_seconds += time.monotonic() - started


class Subject:
    """Optional base class for subjects; documents the protocol and supplies its defaults."""

    name: str = "subject"
    impls: tuple[str, ...] = ("reference", "triton")
    reference_impl: str = "reference"

    def __init__(self, **args: Any):
        self.args = args

    def make_inputs(self) -> Inputs | dict[str, torch.Tensor]:
        # required by the subject protocol: a subclass that forgets it fails on first use
        raise NotImplementedError(f"subject {type(self).__name__} must define make_inputs()")

    def make_state(self) -> dict[str, torch.Tensor] | None:
        return None

    def build(self, impl: str) -> nn.Module:
        raise NotImplementedError(f"subject {type(self).__name__} must define build(impl)")

    def call(self, module: nn.Module, inputs: Inputs) -> Any:
        return module(**inputs.tensors)


_REQUIRED = ("make_inputs", "build")

# Built-in subjects: name -> "module:factory" inside parity.run.subjects, imported on first use so
# that `import parity.run.subjects` stays light.
BUILTINS: dict[str, str] = {
    "attention": "parity.run.subjects.attention:AttentionSubject",
    "decoder": "parity.run.subjects.decoder:DecoderSubject",
}

# Specs trusted by code running on this host (trust_subject), in addition to the built-ins.
_TRUSTED: set[str] = set()

TRUST_HINT = ("add it to trust = [...] under [tool.parity] in ./pyproject.toml (read by default) or in the "
              "file given to --tolerances")


def register_subject(name: str, target: str) -> None:
    """Make ``name`` an alias of ``"package.module:factory"`` (built-ins and plugins)."""
    if ":" in name:
        raise ValueError(f"subject names may not contain ':', got {name!r}")
    BUILTINS[name] = target


def trust_subject(spec: str) -> None:
    """Let bundles on this host name ``spec`` (``package.module:factory``): for library users
    and test suites, which are code on this host and so may vouch for a module."""
    _split_spec(spec, spec)
    _TRUSTED.add(spec)


@contextlib.contextmanager
def trusting(*specs: str) -> Iterator[None]:
    """:func:`trust_subject` for the duration of a ``with`` block (test suites, library callers
    that compare bundles of their own subjects); afterwards only what was trusted before is."""
    added = [spec for spec in specs if spec not in _TRUSTED]
    for spec in specs:
        trust_subject(spec)
    try:
        yield
    finally:
        _TRUSTED.difference_update(added)


def is_builtin(spec: str) -> bool:
    """A built-in name or alias, or the target one of them names."""
    return spec in BUILTINS or spec in BUILTINS.values()


def _dotted(name: str) -> bool:
    return bool(name) and all(part.isidentifier() for part in name.split("."))


def _split_spec(spec: str, shown: str) -> tuple[str, str]:
    """``"pkg.mod:factory"`` -> ``("pkg.mod", "factory")``; a UsageError for anything that is not two
    dotted Python names (no paths, no relative imports, no second colon)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not _dotted(module_name) or not _dotted(attr):
        raise UsageError(f"bad subject spec {printable(shown)!r}; expected package.module:factory")
    return module_name, attr


def check_trusted(spec: Any, trusted: Iterable[str] = (), *, bundle: str | os.PathLike | None = None) -> None:
    """Refuse (UsageError) a subject spec read from a bundle unless this host trusts it.

    Trusted: a built-in (:func:`is_builtin`), a spec in ``trusted`` (the user's ``--subject`` and
    the policy's ``trust`` list) or one given to :func:`trust_subject`. Imports nothing.
    """
    where = f"bundle {printable(os.fspath(bundle))}" if bundle is not None else "the bundle"
    if not isinstance(spec, str) or not spec:
        raise UsageError(f"{where} names no usable subject spec: {shown(spec)}")
    if is_builtin(spec):
        return
    if ":" not in spec:
        known = ", ".join(sorted(BUILTINS))
        raise UsageError(f"{where} names unknown subject {printable(spec)!r}; this host knows the built-ins "
                         f"({known}) and package.module:factory specs it trusts")
    _split_spec(spec, spec)
    if spec in _TRUSTED or spec in tuple(trusted):
        return
    raise UsageError(f"{where} names subject {printable(spec)!r}, which this host does not trust; pass "
                     f"--subject {shlex.quote(printable(spec))} or {TRUST_HINT}")


# ---------------------------------------------------------------------------------------------
# Import path hygiene


def _resolved(entry: Any) -> Path | None:
    if not isinstance(entry, str):
        return None
    try:
        return Path(entry or os.getcwd()).resolve()
    except (OSError, RuntimeError, ValueError):
        return None


def _is_inside(path: Path | None, directory: Path) -> bool:
    return path is not None and (path == directory or directory in path.parents)


def add_cwd_to_sys_path() -> None:
    """Put the current directory first on ``sys.path``, as ``python -m`` does, so that the
    ``parity`` console script finds ``mypkg.subjects:make`` in the current directory too. The CLI
    calls it only for a subject spec the user named (command line or their own config), never
    for one that comes only from a bundle."""
    cwd = Path(os.getcwd()).resolve()
    if not any(_resolved(entry) == cwd for entry in sys.path):
        sys.path.insert(0, str(cwd))


def remove_from_sys_path(directory: str | os.PathLike) -> list[str]:
    """Take every ``sys.path`` entry at or below ``directory`` off the path (the current
    directory's ``''`` too, when it is there) and return them: a bundle's directory must never
    be where Python finds modules, for the subject or for anything imported later."""
    root = Path(directory).resolve()
    removed = [entry for entry in sys.path if _is_inside(_resolved(entry), root)]
    if removed:
        sys.path[:] = [entry for entry in sys.path if entry not in removed]
    return removed


def _module_location(module: Any) -> list[Path]:
    places = []
    file = getattr(module, "__file__", None)
    if isinstance(file, str):
        places.append(Path(file).resolve())
    for entry in list(getattr(module, "__path__", None) or []):
        if isinstance(entry, str):
            places.append(Path(entry).resolve())
    return places


@contextlib.contextmanager
def _bundle_free_import(module_name: str, spec: str, exclude_dirs: Iterable[str | os.PathLike]) -> Iterator[None]:
    """Import ``module_name`` with no ``sys.path`` entry inside ``exclude_dirs`` (bundle or
    rank-set directories), refusing before anything is imported when the module or any parent
    package (its ``__init__``, a namespace package's directories) would come from one of them.

    Where each level would be loaded from is worked out without importing any of them
    (:func:`parity.run.subjects.loading.module_locations`); the check after the import stays, for
    a level whose finder could not be asked without importing."""
    roots = [Path(directory).resolve() for directory in exclude_dirs]
    top = module_name.partition(".")[0]
    removed_entries: dict[Path, list[str]] = {}
    for root in roots:
        removed_entries[root] = remove_from_sys_path(root)
        loaded = sys.modules.get(top)
        if loaded is not None and any(_is_inside(place, root) for place in _module_location(loaded)):
            raise UsageError(f"subject {printable(spec)!r}: module {top!r} was loaded from inside the bundle "
                             f"directory {printable(str(root))}; parity never runs code from a bundle")
    try:
        locations = module_locations(module_name)
    except UnresolvedModule:
        locations = None  # the check after the import judges what was loaded
    for root in roots:
        for location in locations or []:
            inside = next((place for place in location.places if _is_inside(place, root)), None)
            if inside is not None:
                what = "module" if location.name == module_name else "parent package"
                raise UsageError(f"subject {printable(spec)!r}: {what} {location.name!r} would be loaded from "
                                 f"{printable(str(inside))}, inside the bundle directory {printable(str(root))}; "
                                 "parity never runs code from a bundle")
        # A module the bundle ships, and that nothing else on the path provides: say so, rather
        # than "no module named". Finding a top-level module's spec runs none of its code.
        if locations == [] and importlib.machinery.PathFinder.find_spec(
                top, [str(root), *removed_entries[root]]) is not None:
            raise UsageError(f"subject {printable(spec)!r}: module {top!r} is inside the bundle directory "
                             f"{printable(str(root))}; parity never imports code from a bundle (keep the "
                             f"subject's code outside the bundle and run from another directory)")
    yield
    module = sys.modules.get(module_name)
    for root in roots:
        if module is not None and any(_is_inside(place, root) for place in _module_location(module)):
            raise UsageError(f"subject {printable(spec)!r}: module {module_name!r} resolved to inside the bundle "
                             f"directory {printable(str(root))}; parity never runs code from a bundle")


def _resolve_factory(spec: str, exclude_dirs: Iterable[str | os.PathLike] = ()) -> Callable[..., Any]:
    target = BUILTINS.get(spec, spec)
    if ":" not in target:
        known = ", ".join(sorted(BUILTINS))
        raise UsageError(f"unknown subject {printable(spec)!r}{did_you_mean(spec, BUILTINS)}; use a built-in "
                         f"({known}) or package.module:factory")
    module_name, attr = _split_spec(target, spec)
    with _bundle_free_import(module_name, spec, exclude_dirs):
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:  # the spec names nothing importable here: fix the spec or the environment
            detail = " ".join(str(err).split())
            raise UsageError(
                f"cannot import subject module {module_name!r} of {printable(spec)!r}: "
                f"{type(err).__name__}: {printable(detail)}"
            ) from None
        except Exception as err:  # the module's own code raised while it loaded: a bug in it
            raise SubjectError(spec, "import", err) from err
    factory: Any = module
    for part in attr.split("."):
        try:
            factory = getattr(factory, part)
        except AttributeError:
            raise UsageError(f"subject module {module_name!r} has no attribute {attr!r} (from {spec!r})") from None
    if not callable(factory):
        raise UsageError(f"subject factory {spec!r} is a {type(factory).__name__}, not callable")
    return factory


def _check_json_safe(value: Any, what: str) -> None:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise UsageError(f"{what} must be JSON-safe: {err}") from None


# ---------------------------------------------------------------------------------------------
# Memory


def host_memory_bytes(device: torch.device | str | None = None) -> int | None:
    """Total memory of ``device``: a GPU's own memory for ``cuda``, else the host's RAM (the
    smaller of physical memory and a cgroup limit). None when it cannot be told."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        try:
            return int(torch.cuda.get_device_properties(dev).total_memory)
        except Exception:  # no such GPU: check_device reports that with a better message
            return None
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        total = None
    try:  # containers: cgroup v2 limit, "max" when unlimited
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit() and (total is None or int(limit) < total):
            total = int(limit)
    except OSError:
        pass
    return total


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def check_memory(subject: str, needs: Iterable[tuple[str, int]], *, named: str,
                 device: torch.device | str | None = None) -> None:
    """Refuse (UsageError, before anything is allocated) a subject whose estimated memory exceeds
    the device's total: ``subject decoder: seq_len=100000 needs about 34.2 GiB of memory (18.3 GiB
    for attention scores), this host has 23.4 GiB``. ``needs``: (purpose, bytes); ``named``: the arguments
    that drive the estimate, as the message shows them."""
    needs = [(what, int(nbytes)) for what, nbytes in needs]
    total = sum(nbytes for _, nbytes in needs)
    limit = host_memory_bytes(device)
    if limit is None or total <= limit:
        return
    what, biggest = max(needs, key=lambda need: need[1])
    dev = torch.device(device) if device is not None else torch.device("cpu")
    where = "this host has" if dev.type == "cpu" else f"{dev} has"
    raise UsageError(f"subject {subject}: {named} needs about {gib(total)} of memory ({gib(biggest)} for {what}), "
                     f"{where} {gib(limit)}")


def describe_sizes(values: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> str:
    """``seq_len=100000 heads=8``: the arguments that differ from their defaults (all of them if
    none does), for memory messages."""
    changed = {k: v for k, v in values.items() if defaults is None or defaults.get(k) != v} or dict(values)
    return " ".join(f"{k}={shown(v)}" for k, v in changed.items())


# ---------------------------------------------------------------------------------------------
# Runner


def _single_device(module: nn.Module) -> torch.device | None:
    """The accelerator every parameter and buffer of ``module`` is on, where there is one; None for
    the CPU, the meta device and a module spread over devices (its state is then read onto the
    CPU and ``load_state_dict`` copies each tensor where its parameter is)."""
    devices = {tensor.device for tensor in (*module.parameters(), *module.buffers())}
    if len(devices) != 1:
        return None
    device = devices.pop()
    return None if device.type in ("cpu", "meta") else device


def _out_of_memory_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [MemoryError]
    for owner, name in ((torch, "OutOfMemoryError"), (torch.cuda, "OutOfMemoryError")):
        found = getattr(owner, name, None)
        if isinstance(found, type):
            types.append(found)
    return tuple(types)


class SubjectRunner:
    """A loaded subject plus the steps both hosts run it with: inputs, state, build, call.

    Capture: ``inputs = runner.make_inputs(); state = runner.make_state()``, store both.
    Compare: take ``inputs`` and ``state`` from the bundle instead. Then on either host::

        module = runner.build(impl, state=state, device=device)
        output = runner.run(module, inputs.to(device))

    Every call into the subject's code goes through :meth:`_guarded`: a UsageError it raises
    stays one (exit 2), running out of memory is a UsageError naming the stage, and anything
    else becomes a SubjectError (exit 3) carrying the original exception.
    """

    def __init__(self, spec: str, subject: Any):
        missing = [attr for attr in _REQUIRED if not callable(getattr(subject, attr, None))]
        if missing:
            raise UsageError(
                f"subject factory {spec!r} returned a {type(subject).__name__} without "
                f"{', '.join(missing)}; see the subject protocol in parity.run.subjects"
            )
        args = getattr(subject, "args", None)
        if not isinstance(args, dict) or not all(isinstance(key, str) for key in args):
            raise UsageError(f"subject {spec!r} must have an 'args' dict with string keys (JSON-safe)")
        _check_json_safe(args, f"arguments of subject {spec!r}")
        self.spec = spec
        self.subject = subject
        # The protocol's placeholder name ("subject", a Subject subclass that names nothing) says
        # nothing and reads "subject subject" in every message: the spec names it instead.
        name = getattr(subject, "name", None)
        self.name = str(name) if name and str(name) != Subject.name else spec
        self.args: dict[str, Any] = json.loads(json.dumps(args))
        impls = getattr(subject, "impls", None)
        self.impls: tuple[str, ...] | None = tuple(impls) if impls is not None else None
        self.reference_impl: str = getattr(subject, "reference_impl", "reference")

    def _guarded(self, stage: str, function: Callable[..., Any], *args: Any) -> Any:
        try:
            return function(*args)
        except ParityError:  # validation (UsageError, BundleError from the recorder's hooks), or already wrapped
            raise
        except _out_of_memory_types() as err:
            detail = " ".join(str(err).split())[:200]
            raise UsageError(f"subject {self.name} ({stage}) ran out of memory: {type(err).__name__}: "
                             f"{printable(detail)}; use smaller sizes") from err
        except (Exception, SystemExit) as err:  # SystemExit too: a subject's exit(0) is not a verdict
            raise SubjectError(self.spec, stage, err) from err

    def describe(self) -> dict[str, Any]:
        """What the manifest records so the other host can :func:`load_subject` it again."""
        return {"spec": self.spec, "name": self.name, "args": self.args}

    def case_ids(self, children: Iterable[str]) -> list[str]:
        """The subject's independent cases: the ``id`` of each item of ``subject.cases`` where it has
        at least two and each is one of ``children`` (the names of the built model's child modules,
        or of a bundle's top-level layers), as the attention subject's case sets are; else [].
        Their tensors do not feed one another."""
        cases = getattr(self.subject, "cases", None)
        if not isinstance(cases, (list, tuple)) or len(cases) < 2:
            return []
        ids = [getattr(case, "id", None) for case in cases]
        names = set(children)
        return ids if all(isinstance(case_id, str) and case_id in names for case_id in ids) else []

    def check_impl(self, impl: str) -> None:
        if self.impls is not None and impl not in self.impls:
            raise UsageError(f"subject {self.name} has no implementation {impl!r}; choose from {', '.join(self.impls)}")

    def make_inputs(self) -> Inputs:
        made = self._guarded("make_inputs", self.subject.make_inputs)
        inputs = made if isinstance(made, Inputs) else Inputs(dict(made) if isinstance(made, Mapping) else made)
        if not isinstance(inputs.tensors, dict):
            raise UsageError(f"subject {self.name}: make_inputs() must return a dict of tensors or Inputs")
        for key, tensor in inputs.tensors.items():
            if not isinstance(key, str) or not isinstance(tensor, torch.Tensor):
                raise UsageError(f"subject {self.name}: input {key!r} must be a tensor under a string name")
            if tensor.device.type != "cpu":
                raise UsageError(
                    f"subject {self.name}: input {key!r} was made on {tensor.device}; make inputs on the CPU "
                    "(GPU random generators differ between vendors)"
                )
        _check_json_safe(inputs.meta, f"subject {self.name}: input metadata")
        return inputs

    def make_state(self, impl: str | None = None) -> dict[str, torch.Tensor]:
        """The weights to store: ``make_state()``, else the state_dict of a fresh CPU build."""
        state = self.made_state()
        if state is None:
            state = self.build_module(impl or self.reference_impl, "cpu").state_dict()
        return self._checked_state(state)

    def made_state(self) -> dict[str, torch.Tensor] | None:
        """The subject's own ``make_state()``, checked; None where it has none (or it returns None):
        then the built module's own weights are the state (capture stores them from the module)."""
        maker = getattr(self.subject, "make_state", None)
        state = self._guarded("make_state", maker) if callable(maker) else None
        return None if state is None else self._checked_state(state)

    def _checked_state(self, state: Any) -> dict[str, torch.Tensor]:
        if not isinstance(state, Mapping):
            raise UsageError(f"subject {self.name}: make_state() must return a dict of tensors, "
                             f"got {type(state).__name__}")
        for name, tensor in state.items():
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise UsageError(f"subject {self.name}: state {name!r} must be a tensor under a string name")
        state = {name: tensor.detach() for name, tensor in state.items()}
        for name, tensor in state.items():
            if tensor.device.type != "cpu":
                raise UsageError(f"subject {self.name}: state tensor {name!r} was made on {tensor.device}, not the CPU")
        return state

    def check_memory(self, device: torch.device | str, state: Mapping[str, torch.Tensor] | None = None) -> None:
        """Refuse up front what the subject estimates would not fit ``device`` (``memory_needs``),
        with what loading ``state`` holds there beyond the module where it is a StateSource read
        onto that device (the chunk being loaded and the read-ahead: :func:`staged_state_bytes`)."""
        needs = getattr(self.subject, "memory_needs", None)
        if callable(needs):
            estimate = list(self._guarded("memory_needs", needs))
            if isinstance(state, StateSource) and torch.device(device).type != "cpu":
                estimate.append(("weights staged while they are loaded",
                                 staged_state_bytes(state.nbytes(name) for name in state)))
            named = getattr(self.subject, "sizes_text", None) or describe_sizes(self.args)
            check_memory(self.name, estimate, named=str(named), device=device)

    def build(
        self,
        impl: str,
        *,
        state: Mapping[str, torch.Tensor] | None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> nn.Module:
        """Build for ``impl``, load ``state`` (strictly), move to ``device``, cast to ``dtype`` if given.

        ``dtype`` casts floating parameters and buffers (for reference runs in fp32/fp64).
        """
        self.check_impl(impl)
        if torch.device(device).type != "cpu":
            self.check_memory(device, state)  # the CPU side was checked when the subject was created
        checker = getattr(self.subject, "check_state", None)
        if state and callable(checker):  # a StateSource is passed as it is: the check reads what it needs
            self._guarded("check_state", checker, state if isinstance(state, StateSource) else dict(state))
        module = self.build_module(impl, device if self.builds_on_device else "cpu")
        if state:
            self.load_state(module, state, impl)
        placer = getattr(self.subject, "place", None)
        if callable(placer):  # modules on several devices: the subject places them (dtype below keeps devices)
            module = self._guarded("place", placer, module, torch.device(device))
            if not isinstance(module, nn.Module):
                raise UsageError(f"subject {self.name}: place() returned a {type(module).__name__}, not an nn.Module")
        try:
            if not callable(placer):
                module = module.to(device)
            if dtype is not None:
                module = module.to(dtype)
        except _out_of_memory_types() as err:
            raise UsageError(f"subject {self.name}: the module does not fit {device}: "
                             f"{' '.join(str(err).split())[:200]}") from err
        return module.eval()

    @property
    def builds_on_device(self) -> bool:
        """Whether the subject's ``build`` takes ``device`` (builds where the weights will be)."""
        try:
            return "device" in inspect.signature(self.subject.build).parameters
        except (TypeError, ValueError):
            return False

    def build_module(self, impl: str, device: torch.device | str = "cpu") -> nn.Module:
        """The subject's bare module for ``impl``, built on ``device`` where the subject takes one
        (else on the CPU, or under ``torch.device("meta")`` for the meta device); no state loaded."""
        device = torch.device(device)
        if self.builds_on_device:
            module = self._guarded("build", lambda: self.subject.build(impl, device=device))
        elif device.type == "meta":
            def on_meta() -> Any:
                with torch.device("meta"):
                    return self.subject.build(impl)
            module = self._guarded("build", on_meta)
        else:
            module = self._guarded("build", self.subject.build, impl)
        if not isinstance(module, nn.Module):
            raise UsageError(f"subject {self.name}: build({impl!r}) returned a {type(module).__name__}, not an nn.Module")
        return module

    def load_state(self, module: nn.Module, state: Mapping[str, torch.Tensor], impl: str) -> None:
        """Load ``state`` strictly into ``module`` (copied into its tensors, on their devices); a
        StateSource is loaded in chunks of about STATE_CHUNK_BYTES and read ahead of them by at most
        STATE_READ_AHEAD_BYTES, so the host holds about two chunks of it, never the whole state."""
        expected = set(module.state_dict().keys())
        problems = []
        missing = [key for key in module.state_dict() if key not in state]
        unexpected = [key for key in state if key not in expected]
        if missing:
            problems.append(f"missing {', '.join(missing[:5])}")
        if unexpected:
            problems.append(f"unexpected {', '.join(printable(key, limit=80) for key in unexpected[:5])}")
        if problems:
            raise UsageError(
                f"stored state does not fit the module subject {self.name} builds for impl {impl!r}: "
                + "; ".join(problems)
            )

        def load(chunk: dict[str, torch.Tensor]) -> None:
            try:
                module.load_state_dict(chunk, strict=False)
            except RuntimeError as err:  # shape mismatches
                detail = " ".join(str(err).split())
                raise UsageError(f"stored state does not fit subject {self.name} (impl {impl!r}): {detail}") from None

        if not isinstance(state, StateSource):
            load(dict(state))
            return
        # The next tensors are read (and checksummed, and copied to the module's device) on
        # background threads while this chunk is copied into the module: reading at the disk's
        # speed needs the reads to overlap the copies rather than alternate with them.
        chunk: dict[str, torch.Tensor] = {}
        held = 0
        for key, tensor in state.stream(list(state), device=_single_device(module)):
            if chunk and held + state.nbytes(key) > STATE_CHUNK_BYTES:
                load(chunk)
                chunk, held = {}, 0
            chunk[key] = tensor
            held += state.nbytes(key)
            del tensor
        if chunk:
            started = time.monotonic()
            load(chunk)
            # stream() stopped its clock when it handed over the last tensor: the last chunk's copy
            # into the module is part of loading the weights too
            state.stream_seconds += time.monotonic() - started

    def build_sharing(self, impl: str, source: nn.Module,
                      prepare: Callable[[nn.Module], Any] | None = None) -> nn.Module:
        """The module for ``impl`` holding ``source``'s own parameter and buffer tensors (no copy):
        built on the meta device, then every parameter and buffer assigned by name from ``source``
        (the per-module reference replays the reference implementation on the live weights).
        ``prepare(module)`` runs on the meta module before the assignment: a split over ranks
        (``parallelize``) installs there the same hooks and tensor kinds ``source`` has."""
        self.check_impl(impl)
        try:
            module = self.build_module(impl, "meta")
        except SubjectError as err:  # a build that reads the tensors it makes cannot run on meta
            raise UsageError(f"subject {self.name}: build({impl!r}) fails on the meta device ({type(err.error).__name__}: "
                             f"{printable(str(err.error), limit=120)}); give "
                             "build a device parameter, or capture with --reference-scope model") from None
        if prepare is not None:
            prepare(module)
        tensors = dict(source.named_parameters(remove_duplicate=False))
        tensors.update(source.named_buffers(remove_duplicate=False))
        for group in ("_parameters", "_buffers"):
            named = (module.named_parameters if group == "_parameters" else module.named_buffers)(remove_duplicate=False)
            for name, _ in list(named):
                if name not in tensors:
                    raise UsageError(f"subject {self.name}: impl {impl!r} has {group[1:-1]} {name!r}, which the "
                                     "captured implementation has not; the per-module reference needs the same "
                                     "parameters and buffers in every impl")
                owner_path, _, leaf = name.rpartition(".")
                getattr(module.get_submodule(owner_path), group)[leaf] = tensors[name]
        return module.eval()

    def check_inputs(self, inputs: Inputs) -> None:
        """The subject's own check of inputs it is about to run (``check_inputs``, optional)."""
        checker = getattr(self.subject, "check_inputs", None)
        if callable(checker):
            self._guarded("check_inputs", checker, inputs)

    def call(self, module: nn.Module, inputs: Inputs) -> Any:
        caller = getattr(self.subject, "call", None)
        if callable(caller):
            return self._guarded("forward", caller, module, inputs)
        return self._guarded("forward", lambda: module(**inputs.tensors))

    def run(self, module: nn.Module, inputs: Inputs) -> Any:
        """``check_inputs`` then ``call``, without autograd (capture and compare never need gradients)."""
        self.check_inputs(inputs)
        with torch.no_grad():
            return self.call(module, inputs)


def _check_arguments(spec: str, signature: inspect.Signature, args: Mapping[str, Any]) -> None:
    """UsageError naming the arguments a factory does not take (and those it does), or the
    binding problem (a required argument missing)."""
    try:
        signature.bind(**args)
    except TypeError as err:
        params = signature.parameters.values()
        named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        unknown = [] if any(p.kind == p.VAR_KEYWORD for p in params) else sorted(set(args) - set(named))
        if unknown:
            raise UsageError(f"subject {printable(spec)!r} takes no argument {', '.join(map(printable, unknown))}; "
                             f"it takes {', '.join(named) or 'none'}") from None
        raise UsageError(f"subject {printable(spec)!r}: {err}") from None


def load_subject(spec: str, args: Mapping[str, Any] | None = None, *,
                 exclude_dirs: Iterable[str | os.PathLike] = ()) -> SubjectRunner:
    """Create a subject from a built-in name or ``package.module:factory`` and keyword ``args``.

    Every failure of the spec or the arguments is a UsageError naming the spec: an unknown name,
    a bad spec, an import error, a missing or non-callable factory, arguments the factory does not
    take (or that a built-in rejects), or a returned object that is not a subject. An exception
    the factory's own code raises is a SubjectError. No module inside ``exclude_dirs`` (bundle
    directories) is imported.
    """
    if not isinstance(spec, str) or not spec:
        raise UsageError(f"bad subject spec {shown(spec)}")
    if args is not None and not isinstance(args, Mapping):
        raise UsageError(f"arguments of subject {printable(spec)!r} must be a mapping, got {type(args).__name__}")
    factory = _resolve_factory(spec, exclude_dirs)
    args = dict(args or {})
    if not all(isinstance(key, str) for key in args):
        raise UsageError(f"arguments of subject {printable(spec)!r} must have string names")
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # no signature available (some builtins); let the call decide
        signature = None
    if signature is not None:
        _check_arguments(spec, signature, args)
    try:
        subject = factory(**args)
    except ParityError:
        raise
    except (Exception, SystemExit) as err:
        raise SubjectError(spec, "create", err) from err
    return SubjectRunner(spec, subject)


def runner_from_manifest(subject: Mapping[str, Any], *, trusted: Iterable[str] = (),
                         bundle_dir: str | os.PathLike | None = None) -> SubjectRunner:
    """Re-create the subject a bundle was captured with (its manifest's ``subject`` object),
    if this host trusts it (:func:`check_trusted`; ``trusted``: the specs the user named). The
    check comes first; the import never looks inside ``bundle_dir``, which leaves ``sys.path``."""
    where = f"bundle {printable(os.fspath(bundle_dir))}" if bundle_dir is not None else "bundle"
    if not isinstance(subject, Mapping):
        raise UsageError(f"{where}: manifest names no usable subject (subject is a {type(subject).__name__})")
    spec = subject.get("spec")
    args = subject.get("args")
    args = {} if args is None else args
    check_trusted(spec, tuple(trusted), bundle=bundle_dir)
    if not isinstance(args, dict):
        raise UsageError(f"{where}: manifest subject args must be an object, got {type(args).__name__}")
    if bundle_dir is None:
        return load_subject(spec, args)
    try:
        return load_subject(spec, args, exclude_dirs=(bundle_dir,))
    except UsageError as err:  # the arguments are the bundle's: say which bundle
        raise UsageError(f"{where}: {err}") from None
