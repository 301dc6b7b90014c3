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
    call(module, inputs: Inputs) -> Any
                                    # optional; runs the module (default: module(**inputs.tensors))

The harness, never the subject, loads the stored state into the module, moves module and inputs
to the device, and casts to a higher precision for reference runs (:class:`SubjectRunner`). So
the compare host builds the module from the bundle's inputs and state, never from a seed.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..errors import UsageError

DTYPES: dict[str, torch.dtype] = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}
DTYPE_LABELS = {dtype: label for label, dtype in DTYPES.items()}


def check_ints(what: str, values: Mapping[str, Any], minimum: int) -> None:
    """Raise a UsageError naming the first of ``values`` that is not an integer >= ``minimum``
    (1: "a positive integer", 0: "a non-negative integer"); bools are not integers here."""
    bound = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise UsageError(f"{what} {name} must be {bound}, got {value!r}")


def parse_dtype(label: str) -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16``; a UsageError names the bad value."""
    try:
        return DTYPES[label]
    except (KeyError, TypeError):
        raise UsageError(f"unknown dtype {label!r}; choose from {', '.join(DTYPES)}") from None


@dataclasses.dataclass
class Inputs:
    """A subject's inputs: named tensors (stored in the bundle) and JSON-safe metadata (in the manifest)."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to(self, device: torch.device | str, float_dtype: torch.dtype | None = None) -> "Inputs":
        """Move every tensor to ``device``; with ``float_dtype``, cast floating tensors to it."""
        moved = {}
        for name, tensor in self.tensors.items():
            if float_dtype is not None and tensor.is_floating_point():
                moved[name] = tensor.to(device=device, dtype=float_dtype)
            else:
                moved[name] = tensor.to(device)
        return Inputs(moved, self.meta)


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

# Built-in subjects: name -> "module:factory" inside parity.subjects, imported on first use so
# that `import parity.subjects` stays light.
BUILTINS: dict[str, str] = {
    "attention": "parity.subjects.attention:AttentionSubject",
    "decoder": "parity.subjects.decoder:DecoderSubject",
}


def register_subject(name: str, target: str) -> None:
    """Make ``name`` an alias of ``"package.module:factory"`` (built-ins and plugins)."""
    if ":" in name:
        raise ValueError(f"subject names may not contain ':', got {name!r}")
    BUILTINS[name] = target


def _resolve_factory(spec: str) -> Callable[..., Any]:
    target = BUILTINS.get(spec, spec)
    if ":" not in target:
        known = ", ".join(sorted(BUILTINS))
        raise UsageError(f"unknown subject {spec!r}; use a built-in ({known}) or package.module:factory")
    module_name, _, attr = target.partition(":")
    if not module_name or not attr or ":" in attr:
        raise UsageError(f"bad subject spec {spec!r}; expected package.module:factory")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or anything the module raises while it loads
        detail = " ".join(str(err).split())
        raise UsageError(
            f"cannot import subject module {module_name!r} of {spec!r}: {type(err).__name__}: {detail}"
        ) from None
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


class SubjectRunner:
    """A loaded subject plus the steps both hosts run it with: inputs, state, build, call.

    Capture: ``inputs = runner.make_inputs(); state = runner.make_state()``, store both.
    Compare: take ``inputs`` and ``state`` from the bundle instead. Then on either host::

        module = runner.build(impl, state=state, device=device)
        output = runner.run(module, inputs.to(device))
    """

    def __init__(self, spec: str, subject: Any):
        missing = [attr for attr in _REQUIRED if not callable(getattr(subject, attr, None))]
        if missing:
            raise UsageError(
                f"subject factory {spec!r} returned a {type(subject).__name__} without "
                f"{', '.join(missing)}; see the subject protocol in parity.subjects"
            )
        args = getattr(subject, "args", None)
        if not isinstance(args, dict) or not all(isinstance(key, str) for key in args):
            raise UsageError(f"subject {spec!r} must have an 'args' dict with string keys (JSON-safe)")
        _check_json_safe(args, f"arguments of subject {spec!r}")
        self.spec = spec
        self.subject = subject
        self.name = str(getattr(subject, "name", None) or spec)
        self.args: dict[str, Any] = json.loads(json.dumps(args))
        impls = getattr(subject, "impls", None)
        self.impls: tuple[str, ...] | None = tuple(impls) if impls is not None else None
        self.reference_impl: str = getattr(subject, "reference_impl", "reference")

    def describe(self) -> dict[str, Any]:
        """What the manifest records so the other host can :func:`load_subject` it again."""
        return {"spec": self.spec, "name": self.name, "args": self.args}

    def check_impl(self, impl: str) -> None:
        if self.impls is not None and impl not in self.impls:
            raise UsageError(f"subject {self.name} has no implementation {impl!r}; choose from {', '.join(self.impls)}")

    def make_inputs(self) -> Inputs:
        made = self.subject.make_inputs()
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
        maker = getattr(self.subject, "make_state", None)
        state = maker() if callable(maker) else None
        if state is None:
            module = self.subject.build(impl or self.reference_impl)
            state = module.state_dict()
        state = {name: tensor.detach() for name, tensor in state.items()}
        for name, tensor in state.items():
            if tensor.device.type != "cpu":
                raise UsageError(f"subject {self.name}: state tensor {name!r} was made on {tensor.device}, not the CPU")
        return state

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
        module = self.subject.build(impl)
        if not isinstance(module, nn.Module):
            raise UsageError(f"subject {self.name}: build({impl!r}) returned a {type(module).__name__}, not an nn.Module")
        if state:
            try:
                result = module.load_state_dict(dict(state), strict=False)
            except RuntimeError as err:  # shape mismatches
                detail = " ".join(str(err).split())
                raise UsageError(f"stored state does not fit subject {self.name} (impl {impl!r}): {detail}") from None
            problems = []
            if result.missing_keys:
                problems.append(f"missing {', '.join(result.missing_keys[:5])}")
            if result.unexpected_keys:
                problems.append(f"unexpected {', '.join(result.unexpected_keys[:5])}")
            if problems:
                raise UsageError(
                    f"stored state does not fit the module subject {self.name} builds for impl {impl!r}: "
                    + "; ".join(problems)
                )
        module = module.to(device)
        if dtype is not None:
            module = module.to(dtype)
        return module.eval()

    def call(self, module: nn.Module, inputs: Inputs) -> Any:
        caller = getattr(self.subject, "call", None)
        if callable(caller):
            return caller(module, inputs)
        return module(**inputs.tensors)

    def run(self, module: nn.Module, inputs: Inputs) -> Any:
        """``call`` without autograd (capture and compare never need gradients)."""
        with torch.no_grad():
            return self.call(module, inputs)


def load_subject(spec: str, args: Mapping[str, Any] | None = None) -> SubjectRunner:
    """Create a subject from a built-in name or ``package.module:factory`` and keyword ``args``.

    Every failure is a UsageError naming the spec: an unknown name, a bad spec, an import error,
    a missing or non-callable factory, arguments the factory does not take, or a returned object
    that is not a subject.
    """
    if not isinstance(spec, str) or not spec:
        raise UsageError(f"bad subject spec {spec!r}")
    factory = _resolve_factory(spec)
    args = dict(args or {})
    try:
        inspect.signature(factory).bind(**args)
    except TypeError as err:
        raise UsageError(f"subject {spec!r} does not accept arguments {sorted(args)}: {err}") from None
    except ValueError:  # no signature available (some builtins); let the call decide
        pass
    subject = factory(**args)
    return SubjectRunner(spec, subject)


def runner_from_manifest(subject: Mapping[str, Any]) -> SubjectRunner:
    """Re-create the subject a bundle was captured with (its manifest's ``subject`` object)."""
    spec = subject.get("spec")
    args = subject.get("args") or {}
    if not isinstance(spec, str) or not isinstance(args, dict):
        raise UsageError(f"bundle manifest names no usable subject: {dict(subject)!r}")
    return load_subject(spec, args)
