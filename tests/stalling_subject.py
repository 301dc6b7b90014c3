"""A user subject whose capture can be stopped mid-write: the tests' writer to SIGKILL.

Two linear layers, each output large enough to fill its own shard at a small ``--shard-mib``.
With ``PARITY_TEST_STALL=FILE`` in the environment, the second layer's forward creates FILE
(by then the first layer's outputs are on disk in the capture's partial directory) and sleeps,
so a test can kill the capture while it is writing.
"""
from __future__ import annotations

import os
import time

import torch
from torch import nn

from parity.run.subjects import Inputs, Subject


class _Stall(nn.Module):
    def forward(self, x):
        flag = os.environ.get("PARITY_TEST_STALL")
        if flag:
            with open(flag, "w", encoding="utf-8") as handle:
                handle.write(str(os.getpid()))
            time.sleep(600)
        return x


class TwoLayers(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.first = nn.Linear(dim, dim)
        self.stall = _Stall()
        self.second = nn.Linear(dim, dim)

    def forward(self, x):
        return self.second(self.stall(self.first(x)))


class StallingSubject(Subject):
    name = "stalling"
    impls = ("reference",)

    def __init__(self, dim: int = 256, rows: int = 512, tag: int = 0):
        super().__init__(dim=dim, rows=rows, tag=tag)

    def make_inputs(self) -> Inputs:
        gen = torch.Generator().manual_seed(self.args["tag"])
        return Inputs({"x": torch.randn(self.args["rows"], self.args["dim"], generator=gen)})

    def make_state(self) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(1)
        model = TwoLayers(self.args["dim"])
        return {name: torch.randn(t.shape, generator=gen) * 0.05 for name, t in model.state_dict().items()}

    def build(self, impl: str) -> nn.Module:
        return TwoLayers(self.args["dim"])


def make(dim: int = 256, rows: int = 512, tag: int = 0) -> StallingSubject:
    return StallingSubject(dim=dim, rows=rows, tag=tag)
