"""A user subject for determinism and seed checks: ``repeat_subject:make_subject``.

Three stages, ``pre`` -> ``mix`` -> ``post``, of which only ``mix`` has other implementations:

- ``reference``: a row sum, deterministic;
- ``shuffled``: the same sum over the features in an order drawn from an unseeded generator on
  every call, as float atomics accumulate in whatever order the threads arrive (fp32 rounding
  makes the order visible in the bits);
- ``noisy``: the reference plus noise of 1e-7 drawn from an unseeded generator (seeded from the
  operating system's entropy on every call);
- ``clipped``: the reference, but with its input clamped to [-CLIP, CLIP]: equal to the reference
  exactly for inputs inside that range, wrong for inputs with an element beyond it. Which seeds'
  draws have such an element is a property of the inputs alone (:func:`draw_exceeds_clip`).

``pre`` and ``post`` are deterministic, but ``post`` and the root output are computed from
``mix`` and inherit whatever it does: the first nondeterministic layer in execution order is
``mix``.
"""
from __future__ import annotations

import torch
from torch import nn

from parity.run.subjects import Inputs, Subject

CLIP = 3.0
FEATURES = 64


def _unseeded() -> torch.Generator:
    generator = torch.Generator()
    generator.seed()  # from the OS's entropy: a new stream every call
    return generator


class Mix(nn.Module):
    def __init__(self, impl: str):
        super().__init__()
        self.impl = impl

    def forward(self, x):
        if self.impl == "clipped":
            x = x.clamp(-CLIP, CLIP)
        if self.impl == "shuffled":
            order = torch.randperm(x.shape[-1], generator=_unseeded())
            total = torch.zeros_like(x[..., 0])
            for index in order.tolist():  # one accumulation order of many
                total = total + x[..., index]
        else:
            total = x.sum(dim=-1)
        out = x * total.unsqueeze(-1) / x.shape[-1]
        if self.impl == "noisy":
            out = out + 1e-7 * torch.randn(out.shape, generator=_unseeded(), dtype=out.dtype)
        return out


class Model(nn.Module):
    def __init__(self, impl: str):
        super().__init__()
        self.pre = nn.Linear(FEATURES, FEATURES)
        self.mix = Mix(impl)
        self.post = nn.Linear(FEATURES, 4)

    def forward(self, x):
        return self.post(self.mix(self.pre(x)))


class RepeatSubject(Subject):
    name = "repeat-subject"
    impls = ("reference", "shuffled", "noisy", "clipped")

    def __init__(self, seed: int = 0, rows: int = 6):
        super().__init__(seed=seed, rows=rows)

    def make_inputs(self) -> Inputs:
        generator = torch.Generator().manual_seed(self.args["seed"])
        return Inputs({"x": torch.randn(self.args["rows"], FEATURES, generator=generator)})

    def make_state(self) -> dict[str, torch.Tensor]:
        # The weights do not depend on the seed: one model, many input draws. pre is the identity
        # (plus a small bias), so mix sees the drawn inputs themselves and CLIP decides per draw.
        generator = torch.Generator().manual_seed(1234)
        return {"pre.weight": torch.eye(FEATURES), "pre.bias": 0.01 * torch.randn(FEATURES, generator=generator),
                "post.weight": 0.1 * torch.randn(4, FEATURES, generator=generator),
                "post.bias": torch.zeros(4)}

    def build(self, impl: str) -> nn.Module:
        return Model(impl)

    def call(self, module: nn.Module, inputs: Inputs):
        return module(inputs.tensors["x"])


def make_subject(**args) -> RepeatSubject:
    return RepeatSubject(**args)


def draw_exceeds_clip(seed: int, rows: int = 6) -> bool:
    """Whether the draw of ``seed`` reaches ``mix`` with an element beyond CLIP (where ``clipped``
    is wrong): computed from the inputs and weights alone, not by running any implementation."""
    subject = RepeatSubject(seed=seed, rows=rows)
    state = subject.make_state()
    x = subject.make_inputs().tensors["x"]
    pre = x @ state["pre.weight"].T + state["pre.bias"]
    return bool(pre.abs().max() > CLIP)
