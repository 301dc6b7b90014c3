"""A worked user subject: what ``--subject user_subject_example:make_subject`` loads.

It is docs/your-subject.md's example and the tests' user subject. A gated MLP block whose activation has
two implementations (``reference``: exact erf GELU; ``tanh``: the tanh approximation, standing in
for a ported kernel), applied twice with the same weights (so ``block`` is recorded as ``block``
and ``block#1``), returning nested outputs (a dict holding a tuple).
"""
from __future__ import annotations

import torch
from torch import nn

from parity.run.subjects import Inputs, Subject


class GatedBlock(nn.Module):
    def __init__(self, dim: int, approximate: str):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, 2 * dim)
        self.approximate = approximate

    def forward(self, x, *, scale: float = 1.0):
        value, gate = self.proj(self.norm(x)).chunk(2, dim=-1)
        return x + scale * value * nn.functional.gelu(gate, approximate=self.approximate)


class TinyModel(nn.Module):
    def __init__(self, dim: int, impl: str):
        super().__init__()
        self.block = GatedBlock(dim, "none" if impl == "reference" else "tanh")
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        h = self.block(self.block(x), scale=0.5)  # one module, two calls
        logits = self.head(h)
        return {"logits": logits, "stats": (h.mean(dim=-1), h.amax(dim=-1))}


class ExampleSubject(Subject):
    name = "tiny-gated-mlp"
    impls = ("reference", "tanh")

    def __init__(self, dim: int = 16, batch: int = 3, seed: int = 0, dtype: str = "fp32"):
        super().__init__(dim=dim, batch=batch, seed=seed, dtype=dtype)

    @property
    def dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[self.args["dtype"]]

    def make_inputs(self) -> Inputs:
        # Inputs are a pure function of the args: a seeded CPU generator, never the global RNG.
        gen = torch.Generator().manual_seed(self.args["seed"])
        x = torch.randn(self.args["batch"], 5, self.args["dim"], generator=gen)
        return Inputs({"x": x.to(self.dtype)})

    def make_state(self) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.args["seed"] + 1)
        model = TinyModel(self.args["dim"], "reference")
        return {name: (torch.randn(t.shape, generator=gen) * 0.3).to(self.dtype)
                for name, t in model.state_dict().items()}

    def build(self, impl: str) -> nn.Module:
        return TinyModel(self.args["dim"], impl).to(self.dtype)

    def call(self, module: nn.Module, inputs: Inputs):
        return module(inputs.tensors["x"])


def make_subject(**args) -> ExampleSubject:
    """The factory named on the command line: ``user_subject_example:make_subject``."""
    return ExampleSubject(**args)


class MinimalNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x):
        return self.net(x)


class MinimalSubject:
    """The protocol without the base class: no make_state (the weights of the module built on the
    capture host are stored, however it initialised them), no impls (any impl name is passed to
    build) and no call (the module is called as ``module(**inputs)``)."""

    name = "minimal"

    def __init__(self, seed: int = 0):
        self.args = {"seed": seed}

    def make_inputs(self):
        return {"x": torch.randn(2, 8, generator=torch.Generator().manual_seed(self.args["seed"]))}

    def build(self, impl: str) -> nn.Module:
        return MinimalNet()  # default (unseeded) init: only the stored state makes hosts agree


def make_minimal(seed: int = 0) -> MinimalSubject:
    return MinimalSubject(seed)


# Deliberately broken factories for the loader's error messages.
NOT_CALLABLE = 42


def returns_wrong_type():
    return 42


def raises_interrupt_on_recorded_run(**args):
    """A subject whose second run (capture's recorded one) is interrupted, as by Ctrl-C."""
    subject = ExampleSubject(**args)
    runs = {"count": 0}
    original = subject.call

    def call(module, inputs):
        runs["count"] += 1
        if runs["count"] == 2:
            raise KeyboardInterrupt
        return original(module, inputs)

    subject.call = call
    return subject


class _Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * self.calls  # differs on every call: not deterministic run to run


def nondeterministic():
    class Noisy(MinimalSubject):
        name = "noisy"

        def build(self, impl):
            return _Noisy()

    return Noisy()
