"""Recording per-layer tensors with forward hooks, streamed one tensor at a time, and replaying a layer.

Shared by capture (which writes each tensor to a bundle shard as it arrives) and compare (which
compares each tensor with its golden as it arrives, and replays one layer on its golden inputs).

Names. A layer is one call of a module: its name is the module path (``layers.0.attn``; the root
module is ``<root>``), with ``#k`` appended for the k-th repeated call within one run
(``layers.0.attn#1``). A module output or input that is a tuple, list or dict is flattened; each
tensor in it gets a path (``0``, ``logits``, ``0/1``, for inputs ``args/0`` and ``kwargs/mask``)
and the name ``f"{layer}/{path}"`` (just ``layer`` for a bare tensor). Dict keys are escaped
(``%`` -> ``%25``, ``/`` -> ``%2F``) so paths stay unambiguous.

Trees. The structure of an output or input is kept as a JSON tree, so a layer's inputs can be
rebuilt for replay: ``{"tensor": path}``, ``{"tuple": [...]}``, ``{"list": [...]}``,
``{"dict": [[key, node], ...]}``, ``{"value": json_scalar}``, ``{"float": "nan" | "inf" | "-inf"}``,
``{"dtype": "float32"}``, or ``{"opaque": type_name}`` for anything else (which cannot be replayed).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from parity.base import dtypes
from parity.base.errors import UsageError

ROOT = "<root>"

Tree = dict[str, Any]


def module_display_name(module_path: str) -> str:
    """The name a module path is known by in globs and layer names (the root is ``<root>``)."""
    return module_path or ROOT


def layer_name(module_path: str, call_index: int) -> str:
    name = module_display_name(module_path)
    return name if call_index == 0 else f"{name}#{call_index}"


def tensor_name(layer: str, path: str) -> str:
    return f"{layer}/{path}" if path else layer


def _escape(key: str) -> str:
    return key.replace("%", "%25").replace("/", "%2F")


def _join(prefix: str, part: str) -> str:
    return f"{prefix}/{part}" if prefix else part


# --------------------------------------------------------------------------------------------
# Flattening


def flatten(obj: Any, prefix: str = "") -> tuple[Tree, list[tuple[str, torch.Tensor]]]:
    """Split a nested structure into a JSON tree and its tensors, as ``(path, tensor)`` in order."""
    tensors: list[tuple[str, torch.Tensor]] = []
    return _visit(obj, prefix, tensors), tensors


def _visit(node: Any, path: str, tensors: list[tuple[str, torch.Tensor]]) -> Tree:
    # A module-level function, not a closure: a closure that calls itself is a reference cycle
    # (function -> cell -> function) holding ``tensors``, so every recorded output stayed alive
    # until the cyclic garbage collector ran (parity/NUMERICS.md: 2.07 GB vs 1.09 GB peak in capture).
    if isinstance(node, torch.Tensor):
        tensors.append((path, node))
        return {"tensor": path}
    if isinstance(node, (tuple, list)):
        items = [_visit(item, _join(path, str(index)), tensors) for index, item in enumerate(node)]
        return {"tuple" if isinstance(node, tuple) else "list": items}
    if isinstance(node, Mapping):
        pairs = []
        for key, item in node.items():
            json_key = key if isinstance(key, (str, int)) and not isinstance(key, bool) else str(key)
            pairs.append([json_key, _visit(item, _join(path, _escape(str(key))), tensors)])
        return {"dict": pairs}
    if node is None or isinstance(node, (bool, int, str)):
        return {"value": node}
    if isinstance(node, float):
        return {"value": node} if math.isfinite(node) else {"float": repr(node)}
    if isinstance(node, torch.dtype):
        return {"dtype": dtypes.dtype_text(node)}
    return {"opaque": type(node).__qualname__}


def tree_is_replayable(tree: Tree) -> bool:
    """False if the tree holds an object that was not recorded (an ``opaque`` node)."""
    if "opaque" in tree:
        return False
    for kind in ("tuple", "list"):
        if kind in tree:
            return all(tree_is_replayable(item) for item in tree[kind])
    if "dict" in tree:
        return all(tree_is_replayable(item) for _, item in tree["dict"])
    return True


def unflatten(tree: Tree, tensors: Mapping[str, torch.Tensor], *, what: str = "value") -> Any:
    """Rebuild the structure ``flatten`` produced, taking tensors by path from ``tensors``."""
    if "tensor" in tree:
        try:
            return tensors[tree["tensor"]]
        except KeyError:
            raise UsageError(f"{what}: tensor {tree['tensor']!r} was not recorded") from None
    if "tuple" in tree:
        return tuple(unflatten(item, tensors, what=what) for item in tree["tuple"])
    if "list" in tree:
        return [unflatten(item, tensors, what=what) for item in tree["list"]]
    if "dict" in tree:
        return {key: unflatten(item, tensors, what=what) for key, item in tree["dict"]}
    if "value" in tree:
        return tree["value"]
    if "float" in tree:
        return float(tree["float"])
    if "dtype" in tree:
        return getattr(torch, tree["dtype"])
    raise UsageError(f"{what} holds a {tree.get('opaque', 'malformed')} object, which cannot be rebuilt")


def _inputs_structure(args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {"args": tuple(args), "kwargs": dict(kwargs)}


# --------------------------------------------------------------------------------------------
# Recording


@dataclasses.dataclass(frozen=True)
class RecordedTensor:
    """One tensor produced during a run, already copied (to the CPU unless told otherwise)."""

    kind: str  # "output" (or "reference", as the recorder was told) or "module_input"
    name: str
    layer: str
    module: str
    call_index: int
    path: str
    tensor: torch.Tensor


@dataclasses.dataclass
class LayerCall:
    """One recorded call of a module; ``to_json`` is what the bundle's ``layers`` list holds."""

    name: str
    module: str
    call_index: int
    outputs: Tree | None = None
    inputs: Tree | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def select_modules(root: nn.Module, patterns: Sequence[str] | None = None) -> dict[str, nn.Module]:
    """Modules of ``root`` whose display name matches any glob (all modules when ``patterns`` is None).

    Matching is ``fnmatch.fnmatchcase`` on the dotted module path (``layers.*.attn``); the root
    module is ``<root>``. A pattern that matches no module is a UsageError naming it.
    """
    modules = {module_display_name(path): module for path, module in root.named_modules()}
    if patterns is None:
        return modules
    selected: dict[str, nn.Module] = {}
    for pattern in patterns:
        matched = {name: module for name, module in modules.items() if fnmatch.fnmatchcase(name, pattern)}
        if not matched:
            known = ", ".join(list(modules)[:12]) + (", ..." if len(modules) > 12 else "")
            raise UsageError(f"--layers {pattern!r} matches no module; modules are: {known}")
        selected.update(matched)
    return {name: module for name, module in modules.items() if name in selected}


class Recorder:
    """Forward hooks that stream every tensor of the selected modules to ``on_tensor``.

    ``on_tensor(RecordedTensor)`` is called once per tensor, in production order, with a copy
    taken right away (so later in-place changes do not matter) on ``copy_to``: the CPU by default,
    so device memory stays bounded; ``None`` keeps the copy on the tensor's own device.
    ``copy=False`` hands over the module's own tensor (detached) instead, for a consumer that is
    done with it before ``on_tensor`` returns (compare): no copy of every output. Module outputs
    come as ``kind`` (default ``"output"``); with ``record_inputs`` each module's positional and
    keyword inputs come first, as ``"module_input"``. Modules whose output holds no tensor are not
    recorded. ``calls`` lists the recorded :class:`LayerCall` in execution order (a module's call
    completes after its children's). Use as a context manager, or ``attach``/``detach``; ``reset``
    between runs so call indices start again at 0.
    """

    def __init__(
        self,
        root: nn.Module,
        on_tensor: Callable[[RecordedTensor], None],
        *,
        layers: Sequence[str] | None = None,
        record_inputs: bool = False,
        kind: str = "output",
        copy_to: torch.device | str | None = "cpu",
        copy: bool = True,
    ):
        self.root = root
        self.copy_to = copy_to
        self.copy = copy
        self.on_tensor = on_tensor
        self.record_inputs = record_inputs
        self.kind = kind
        self.modules = select_modules(root, layers)
        self.calls: list[LayerCall] = []
        self._handles: list[Any] = []
        self._counts: dict[str, int] = {}
        self._open: dict[str, list[LayerCall]] = {}
        self.tensor_count = 0
        self.byte_count = 0

    def reset(self) -> None:
        self.calls = []
        self._counts = {}
        self._open = {}
        self.tensor_count = 0
        self.byte_count = 0

    def attach(self) -> None:
        if self._handles:
            return
        for name, module in self.modules.items():
            path = "" if name == ROOT else name
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(path), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_hook(path), with_kwargs=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> "Recorder":
        self.attach()
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def _emit(self, kind: str, call: LayerCall, path: str, tensor: torch.Tensor) -> None:
        if not self.copy:
            copy = tensor.detach()
        elif self.copy_to is None:
            copy = tensor.detach().clone()
        else:
            copy = tensor.detach().to(self.copy_to, copy=True)
        self.tensor_count += 1
        self.byte_count += copy.numel() * copy.element_size()
        self.on_tensor(
            RecordedTensor(kind, tensor_name(call.name, path), call.name, call.module, call.call_index, path, copy)
        )

    def _pre_hook(self, path: str):
        def hook(module, args, kwargs):
            index = self._counts.get(path, 0)
            self._counts[path] = index + 1
            call = LayerCall(layer_name(path, index), module_display_name(path), index)
            self._open.setdefault(path, []).append(call)
            if self.record_inputs:
                call.inputs, tensors = flatten(_inputs_structure(args, kwargs))
                for tensor_path, tensor in tensors:
                    self._emit("module_input", call, tensor_path, tensor)
            return None

        return hook

    def _post_hook(self, path: str):
        def hook(module, args, kwargs, output):
            call = self._open[path].pop()
            tree, tensors = flatten(output)
            if not tensors and call.inputs is None:
                return None
            call.outputs = tree
            for tensor_path, tensor in tensors:
                self._emit(self.kind, call, tensor_path, tensor)
            self.calls.append(call)
            return None

        return hook


# --------------------------------------------------------------------------------------------
# Replay


def find_module(root: nn.Module, module: str) -> nn.Module:
    """The submodule of ``root`` with a recorded module name (``<root>`` is ``root`` itself)."""
    if module == ROOT:
        return root
    try:
        return root.get_submodule(module)
    except AttributeError:
        raise UsageError(f"the model has no module {module!r}; was it built by the same subject?") from None


def layer_inputs(layer: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> tuple[tuple, dict]:
    """Rebuild ``(args, kwargs)`` of a recorded layer call from its input tree and tensors by path."""
    tree = layer.get("inputs")
    if tree is None:
        raise UsageError(f"layer {layer['name']!r} has no recorded inputs; capture with --record-inputs")
    structure = unflatten(tree, tensors, what=f"inputs of layer {layer['name']!r}")
    return tuple(structure["args"]), dict(structure["kwargs"])


def replay(root: nn.Module, layer: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> Any:
    """Call one recorded layer's module on its recorded inputs (``tensors``: input path -> tensor).

    ``layer`` is one item of a bundle's ``layers`` list. The caller moves the tensors to the
    device and wraps this in ``torch.no_grad()``. Returns the module's output; ``flatten`` it to
    get tensors by the same paths as the recorded outputs.
    """
    args, kwargs = layer_inputs(layer, tensors)
    return find_module(root, layer["module"])(*args, **kwargs)


def iter_tensor_paths(tree: Tree) -> Iterable[str]:
    """Paths of the tensors in a tree, in order."""
    if "tensor" in tree:
        yield tree["tensor"]
    for kind in ("tuple", "list"):
        for item in tree.get(kind, ()):
            yield from iter_tensor_paths(item)
    for _, item in tree.get("dict", ()):
        yield from iter_tensor_paths(item)
