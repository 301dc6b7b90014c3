"""A stack of equal blocks whose size is set by its arguments: the tests' subject for how capture's memory scales.

``layers`` blocks of two ``width`` x ``width`` linear maps with a residual, weights drawn from
``seed`` on whatever device the model is built on (it takes ``device``: built where the weights
will be) and no ``make_state``, so the built module's own weights are the state. The stack runs
``repeats`` times over its blocks (the same weights): the recorded outputs grow with ``repeats``
(each block's call ``#k``) while the model stays the same size.
"""
from __future__ import annotations

import torch
from torch import nn

from parity.run.subjects import Inputs, Subject


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, width, bias=False)
        self.down = nn.Linear(width, width, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, width: int, layers: int, repeats: int = 1):
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(layers))
        self.repeats = repeats

    def forward(self, x):
        for _ in range(self.repeats):
            for layer in self.layers:
                x = layer(x)
        return x


class StackSubject(Subject):
    name = "stack"
    impls = ("reference",)

    def __init__(self, width: int = 64, layers: int = 4, tokens: int = 8, dtype: str = "float32", seed: int = 0,
                 repeats: int = 1):
        super().__init__(width=width, layers=layers, tokens=tokens, dtype=dtype, seed=seed, repeats=repeats)

    def make_inputs(self):
        gen = torch.Generator().manual_seed(self.args["seed"] + 1)
        x = torch.randn(self.args["tokens"], self.args["width"], generator=gen)
        return Inputs({"x": x.to(getattr(torch, self.args["dtype"]))})

    def build(self, impl: str, device: torch.device | str = "cpu") -> nn.Module:
        torch.manual_seed(self.args["seed"])  # meta tensors draw nothing; CPU weights are the seed's
        with torch.device(device):
            model = Stack(self.args["width"], self.args["layers"], self.args["repeats"])
        return model.to(getattr(torch, self.args["dtype"]))


def make_subject(**args) -> StackSubject:
    return StackSubject(**args)
