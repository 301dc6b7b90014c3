"""The per-module high-precision reference: each recorded module call replayed on its own inputs in fp32 or fp64.

A whole-model reference runs a second, high-precision copy of the model from the subject's inputs
(capture's ``--reference-scope model``): two models in memory. Here instead, during the recorded
run, every selected module call hands its inputs (the tensors the recorder stores as
``module_input`` with ``--record-inputs``), before it runs, to a high-precision replay of that one
module, and the replay's outputs are recorded as ``kind="reference"`` under the same names as the
golden outputs (before those of the modules inside it; the manifest's ``reference_layers`` list
the calls in the order they complete, as ``layers`` does). Nothing of the model is copied as a whole:

- The replay runs the subject's *reference implementation* (``reference_impl``) built on the meta
  device and given the live model's own parameter and buffer tensors (no copy): the same weights,
  the reference's arithmetic (a Triton kernel has no fp64 path; the reference does).
- Inside a replay, each module that owns parameters or buffers casts them to the reference dtype
  when it is called and drops the copies when it returns, so at most one owning module's
  high-precision copy exists at a time (on the device that ran the forward). Peak memory is the
  model, plus the largest owning module's high-precision copy, plus the replayed module's
  high-precision activations, plus the live activations when the call starts (not its output:
  the replay is done before the live call runs).

What the reference means differs from a whole-model one (parity/NUMERICS.md, "Per-module
references"): it is the exact output of one module *on the low-precision inputs the capture host
gave it*, so the capture host's error against it is the error that module introduces, not the
error accumulated from the model's input. Compare therefore uses it for the error budget of the
isolated replay (``--isolate``), where the other host's module also runs on those same inputs.

Cost: a recorded module is replayed once per call, and a module nested ``d`` deep is also run in
each of its ``d`` recorded ancestors' replays, so the reference costs about (nesting depth of the
recorded modules) high-precision forwards; ``--layers`` bounds it.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from parity.base.errors import UsageError
from parity.run.recorder import (
    ROOT,
    LayerCall,
    RecordedTensor,
    flatten,
    layer_name,
    module_display_name,
    select_modules,
    tensor_name,
    unflatten,
)

ROOT_PATH = ""


def _owners(root: nn.Module) -> list[nn.Module]:
    """Modules that hold parameters or buffers directly (not through a child)."""
    return [module for module in root.modules()
            if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))]


class HighPrecisionCast:
    """While ``active``, every owning module of ``root`` runs on ``dtype`` copies of its floating
    parameters and buffers, made when it is called and dropped when it returns.

    The copies live on each tensor's own device. ``restore`` puts every original back (after a
    replay that raised, whose post-hooks did not run)."""

    def __init__(self, root: nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        self.active = False
        self.held_bytes = 0  # of high-precision copies alive now
        self.peak_bytes = 0  # the most alive at once: the largest owning module's copy, nested owners summed
        self._swapped: list[tuple[nn.Module, dict[str, Any], dict[str, Any]]] = []
        self._handles = []
        for module in _owners(root):
            self._handles.append(module.register_forward_pre_hook(self._cast))
            self._handles.append(module.register_forward_hook(self._uncast))

    def _cast(self, module: nn.Module, args: Any) -> None:
        if not self.active:
            return
        params = {name: value for name, value in module._parameters.items()
                  if value is not None and value.is_floating_point()}
        buffers = {name: value for name, value in module._buffers.items()
                   if value is not None and value.is_floating_point()}
        self._swapped.append((module, params, buffers))
        for name, value in params.items():
            module._parameters[name] = value.detach().to(self.dtype)
        for name, value in buffers.items():
            module._buffers[name] = value.to(self.dtype)
        self.held_bytes += self._copy_bytes(params, buffers)
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def _copy_bytes(self, params: dict[str, Any], buffers: dict[str, Any]) -> int:
        size = torch.empty(0, dtype=self.dtype).element_size()
        return sum(value.numel() * size for value in (*params.values(), *buffers.values()))

    def _uncast(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.active:
            return
        for index in range(len(self._swapped) - 1, -1, -1):
            if self._swapped[index][0] is module:
                self._put_back(*self._swapped.pop(index))
                return

    def _put_back(self, module: nn.Module, params: dict[str, Any], buffers: dict[str, Any]) -> None:
        module._parameters.update(params)
        module._buffers.update(buffers)
        self.held_bytes -= self._copy_bytes(params, buffers)

    def restore(self) -> None:
        while self._swapped:
            self._put_back(*self._swapped.pop())

    def remove(self) -> None:
        self.restore()
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _replay_input(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A copy of a live input for the replay: ``dtype`` for floating tensors (a copy even where the
    input already has that dtype), a clone otherwise."""
    tensor = tensor.detach()
    return tensor.to(dtype, copy=True) if tensor.is_floating_point() else tensor.clone()


class ModuleReference:
    """Hooks on the live model's selected modules that replay each call in high precision on
    ``reference_model`` (the reference implementation sharing the live model's tensors) and hand
    every output of the replay to ``on_tensor`` as ``kind="reference"``, named as the recorder
    names the golden outputs (``layers`` are the same globs).

    Attach with a :class:`~parity.run.recorder.Recorder` on the same model and run once; ``calls``
    then lists the replayed calls in the order they completed (the manifest's ``reference_layers``);
    the first replay that raised stops the replays and is re-raised by :meth:`check`.
    """

    def __init__(self, live: nn.Module, reference_model: nn.Module, on_tensor: Callable[[RecordedTensor], None],
                 *, dtype: torch.dtype, layers: Sequence[str] | None = None):
        self.live = live
        self.reference_model = reference_model
        self.on_tensor = on_tensor
        self.dtype = dtype
        self.modules = select_modules(live, layers)
        self.calls: list[LayerCall] = []
        self._counts: dict[str, int] = {}
        self._open: dict[str, list[LayerCall | None]] = {}  # per module: its calls started, not yet returned
        self._handles: list[Any] = []
        self._cast: HighPrecisionCast | None = None
        self._error: BaseException | None = None
        self._error_layer: str | None = None
        self.peak_copy_bytes = 0  # the most bytes of high-precision weight copies alive at once
        # Seconds in the replays (what the host spent there: on a GPU, launching them, and waiting
        # only where a replay itself synchronizes; handing the outputs over is not counted).
        self.seconds = 0.0

    def __enter__(self) -> "ModuleReference":
        self._cast = HighPrecisionCast(self.reference_model, self.dtype)
        for name, module in self.modules.items():
            path = ROOT_PATH if name == ROOT else name
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(path), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_hook(path)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._cast is not None:
            self.peak_copy_bytes = self._cast.peak_bytes
            self._cast.remove()
            self._cast = None

    def _pre_hook(self, path: str):
        # The replay runs before the live call, on its inputs as they arrive: nothing of the live
        # call (its output, its activations) is alive beside the replay's high-precision working
        # set, and the inputs need no copy kept until the call returns (the replay is done before
        # the module could change them in place). The root's live output, at a large vocabulary,
        # is the bf16 logits: half the size of the replay's own fp32 logits.
        def hook(module, args, kwargs):
            index = self._counts.get(path, 0)
            self._counts[path] = index + 1
            self._open.setdefault(path, []).append(None)
            if self._error is not None:
                return None
            name = layer_name(path, index)
            tree, tensors = flatten({"args": tuple(args), "kwargs": dict(kwargs)})
            started = time.monotonic()
            try:
                replayed = self._replay(path, tree, dict(tensors))
            except Exception as err:  # raised after the run by check(), with the layer named
                self._error, self._error_layer = err, name
                return None
            finally:
                self.seconds += time.monotonic() - started
            out_tree, outputs = flatten(replayed)
            del replayed
            if not outputs:
                return None
            call = LayerCall(name, module_display_name(path), index, outputs=out_tree)
            self._open[path][-1] = call
            while outputs:  # each handed over and let go of in turn
                tensor_path, tensor = outputs.pop(0)
                self.on_tensor(RecordedTensor("reference", tensor_name(name, tensor_path), name, call.module,
                                              call.call_index, tensor_path, tensor.detach()))
                del tensor
            return None

        return hook

    def _post_hook(self, path: str):
        # Only the order: a call is listed when it completes, as the recorder lists the outputs'.
        def hook(module, args, output):
            call = self._open[path].pop()
            if call is not None:
                self.calls.append(call)
            return None

        return hook

    def _replay(self, path: str, tree: Any, inputs: dict[str, torch.Tensor]) -> Any:
        """The module at ``path`` of the reference model run on ``inputs`` (the live call's own
        tensors): floating ones as high-precision copies, the others cloned, so that the replay
        never changes the live call's inputs in place."""
        target = self.reference_model if path == ROOT_PATH else self.reference_model.get_submodule(path)
        structure = unflatten(tree, {key: _replay_input(value, self.dtype) for key, value in inputs.items()},
                              what=f"inputs of {module_display_name(path)}")
        assert self._cast is not None
        self._cast.active = True
        try:
            with torch.no_grad():
                return target(*structure["args"], **structure["kwargs"])
        finally:
            self._cast.active = False
            self._cast.restore()

    def check(self) -> None:
        """Raise a UsageError naming the first layer whose high-precision replay raised."""
        if self._error is not None:
            detail = " ".join(str(self._error).split())[:300]
            raise UsageError(f"the per-module reference could not replay layer {self._error_layer!r} in "
                             f"{str(self.dtype).removeprefix('torch.')}: {type(self._error).__name__}: {detail}; "
                             "capture with --reference-scope model instead")
