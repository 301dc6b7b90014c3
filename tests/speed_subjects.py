"""Subjects for ``parity bench`` tests and the H200 story: known speeds, one deliberately wrong impl.

``speed_subjects:make_matmul`` (CPU tests): ``y = x @ W`` with four impls whose speeds and
correctness are known in advance, all from the same weights:

- ``reference``: the product as a sum over ``chunks`` slices of the inner dimension, one small
  matmul each (slow: ``chunks`` kernel calls);
- ``fast``: one matmul (fast, equal to the reference up to fp32 rounding: parity holds);
- ``wrong``: no product at all, ``x`` passed through (the fastest, and wrong: parity fails);
- ``slow``: the reference twice (slower, correct).

``speed_subjects:make_buffers``: an output computed once and returned again (``cached``) and one
written into a persistent buffer (``out_buffer``), for the fresh-output check.

Timing tests do not read the machine's clock: ``virtual_clock`` (a fixture's body) puts
``CLOCK`` in place of the timer of :mod:`parity.speed.timing`, and the matmul subjects' modules
advance it by the cost of what they compute (``UNIT`` seconds per chunk product, ``chunks`` of them
for the reference, one for ``fast``; ``UNIT`` for the tanh; a fixed cycle of +-3% jitter), so the
speedups and verdicts a test asserts are known in advance and do not depend on the machine's load.
What the modules compute is real: parity is judged on their actual outputs.

``speed_subjects:make_decoder`` (the H200 story): the built-in decoder with one more impl,
``skip_attention``, whose attention core returns the values (repeated per query head) instead of
attending: faster than any attention kernel and wrong.

``cpu`` and ``gpu``: profiler events as ``parity.speed.profile.kineto_events`` gives them, for the
accounting tests (torch's ops on thread 1, the device on stream 7).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import parity.run.subjects
from parity.run.subjects import Inputs, Subject
from parity.run.subjects.decoder import DecoderSubject

MATMUL_SPEC = "speed_subjects:make_matmul"
DECODER_SPEC = "speed_subjects:make_decoder"
CASES_SPEC = "speed_subjects:make_cases"
BUFFERS_SPEC = "speed_subjects:make_buffers"
for _spec in (MATMUL_SPEC, DECODER_SPEC, CASES_SPEC, BUFFERS_SPEC):
    parity.run.subjects.trust_subject(_spec)


UNIT = 1e-4  # virtual seconds of one chunk product
JITTER = (1.0, 1.03, 0.98, 1.01, 0.97, 1.02, 0.99)  # median 1.0; the spread of a quiet machine


class VirtualClock:
    """A clock that moves only when a subject's module says what its work costs."""

    def __init__(self):
        self.now = 0.0
        self.calls = 0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, units: float) -> None:
        self.now += units * UNIT * JITTER[self.calls % len(JITTER)]
        self.calls += 1


CLOCK = VirtualClock()


def virtual_clock(monkeypatch):
    """A generator for a fixture: parity.speed.timing reads ``CLOCK``, restarted at zero."""
    import parity.speed.timing

    CLOCK.now, CLOCK.calls = 0.0, 0
    monkeypatch.setattr(parity.speed.timing, "time", CLOCK)
    yield CLOCK


def cost_units(mode: str, chunks: int) -> float:
    """The virtual cost of one ChunkedProjection call (the tanh adds 1 more per forward)."""
    return {"reference": chunks, "slow": 2 * chunks, "fast": 1, "wrong": 0.1}[mode]  # wrong: the call alone


class Tanh(nn.Tanh):
    def forward(self, x):
        CLOCK.advance(1)
        return super().forward(x)


class ChunkedProjection(nn.Module):
    def __init__(self, dim: int, chunks: int, mode: str):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dim))
        self.chunks, self.mode = chunks, mode

    def forward(self, x):
        CLOCK.advance(cost_units(self.mode, self.chunks))
        if self.mode in ("reference", "slow"):
            repeats = 2 if self.mode == "slow" else 1
            for _ in range(repeats):
                out = torch.zeros(x.shape[0], self.weight.shape[1], dtype=x.dtype)
                for xs, ws in zip(x.chunk(self.chunks, dim=1), self.weight.chunk(self.chunks, dim=0)):
                    out = out + xs @ ws
            return out
        if self.mode == "fast":
            return x @ self.weight
        return x  # "wrong": the product skipped


class MatmulModel(nn.Module):
    def __init__(self, dim: int, chunks: int, mode: str):
        super().__init__()
        self.proj = ChunkedProjection(dim, chunks, mode)
        self.act = Tanh()

    def forward(self, x):
        return self.act(self.proj(x))


class MatmulSubject(Subject):
    name = "matmul"
    impls = ("reference", "fast", "wrong", "slow")

    def __init__(self, dim: int = 64, rows: int = 32, chunks: int = 32, seed: int = 0):
        super().__init__(dim=dim, rows=rows, chunks=chunks, seed=seed)

    def make_inputs(self):
        gen = torch.Generator().manual_seed(self.args["seed"])
        return Inputs({"x": torch.randn(self.args["rows"], self.args["dim"], generator=gen)})

    def make_state(self):
        gen = torch.Generator().manual_seed(self.args["seed"] + 1)
        dim = self.args["dim"]
        return {"proj.weight": torch.randn(dim, dim, generator=gen) / dim ** 0.5}

    def build(self, impl):
        return MatmulModel(self.args["dim"], self.args["chunks"], impl)

    def call(self, module, inputs):
        return module(inputs.tensors["x"])


def make_matmul(**args):
    return MatmulSubject(**args)


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    rows: int


class CasesModel(nn.Module):
    """One ChunkedProjection per case, registered under the case id (as the attention subject does)."""

    def __init__(self, cases, dim, chunks, impl, broken):
        super().__init__()
        for case in cases:
            mode = "wrong" if impl == "fast_but_one_wrong" and case.id == broken else \
                ("fast" if impl.startswith("fast") else "reference")
            self.add_module(case.id, ChunkedProjection(dim, chunks, mode))


class CasesSubject(Subject):
    """Three cases of the matmul; ``fast`` is fast and right on all, ``fast_but_one_wrong`` is fast on
    all and wrong on the case ``m48``."""

    name = "matmul-cases"
    impls = ("reference", "fast", "fast_but_one_wrong")

    def __init__(self, dim: int = 64, chunks: int = 32, seed: int = 0):
        super().__init__(dim=dim, chunks=chunks, seed=seed)
        self.cases = (Case("m16", 16), Case("m32", 32), Case("m48", 48))

    def make_inputs(self):
        gen = torch.Generator().manual_seed(self.args["seed"])
        return Inputs({case.id: torch.randn(case.rows, self.args["dim"], generator=gen) for case in self.cases})

    def make_state(self):
        gen = torch.Generator().manual_seed(self.args["seed"] + 1)
        dim = self.args["dim"]
        return {f"{case.id}.weight": torch.randn(dim, dim, generator=gen) / dim ** 0.5 for case in self.cases}

    def build(self, impl):
        return CasesModel(self.cases, self.args["dim"], self.args["chunks"], impl, "m48")

    def call(self, module, inputs):
        return {case.id: module._modules[case.id](inputs.tensors[case.id]) for case in self.cases}


def make_cases(**args):
    return CasesSubject(**args)


class BufferedProjection(nn.Module):
    """``x @ W`` three ways: a fresh output (``reference``); the product of the first call, returned
    again every call (``cached``: right in value, and no work after the first call); the product
    written into one persistent buffer every call (``out_buffer``: reused memory, rewritten)."""

    def __init__(self, dim: int, mode: str):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dim))
        self.mode = mode
        self.kept = None  # a plain attribute: neither a parameter nor a buffer

    def forward(self, x):
        if self.mode == "reference":
            return x @ self.weight
        if self.kept is None:
            self.kept = x @ self.weight
        elif self.mode == "out_buffer":
            torch.matmul(x, self.weight, out=self.kept)
        return self.kept


class BuffersSubject(Subject):
    name = "buffers"
    impls = ("reference", "cached", "out_buffer")

    def __init__(self, dim: int = 32, rows: int = 16, seed: int = 0):
        super().__init__(dim=dim, rows=rows, seed=seed)

    def make_inputs(self):
        gen = torch.Generator().manual_seed(self.args["seed"])
        return Inputs({"x": torch.randn(self.args["rows"], self.args["dim"], generator=gen)})

    def make_state(self):
        gen = torch.Generator().manual_seed(self.args["seed"] + 1)
        return {"weight": torch.randn(self.args["dim"], self.args["dim"], generator=gen)}

    def build(self, impl):
        return BufferedProjection(self.args["dim"], impl)

    def call(self, module, inputs):
        return module(inputs.tensors["x"])


def make_buffers(**args):
    return BuffersSubject(**args)


class SkipAttention(nn.Module):
    """Returns v repeated per query head: the attention core's shape, none of its work."""

    def forward(self, q, k, v, layout, layout_meta):
        return v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)


class DecoderWithWrongImpl(DecoderSubject):
    impls = ("reference", "triton", "skip_attention")

    def build(self, impl):
        if impl != "skip_attention":
            return super().build(impl)
        model = super().build("reference")
        for layer in model.layers:
            layer.attn.core = SkipAttention()
        return model


def make_decoder(**args):
    return DecoderWithWrongImpl(**args)


def one_thread():
    """A generator for a fixture: torch on one CPU thread while a test times (a small GEMM on two
    threads of a loaded machine took 13 ms instead of 4 us, thread contention), then as before."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cpu(name, kind, start, dur, correlation=0, thread=1, linked=0):
    from parity.speed.profile import Event

    return Event(name, kind, start, dur, thread=thread, correlation=correlation, linked=linked)


def gpu(name, kind, start, dur, correlation=0, linked=0):
    from parity.speed.profile import Event

    return Event(name, kind, start, dur, thread=7, correlation=correlation, linked=linked, on_device=True)


# The timing test files' fixtures, imported by name into each (a fixture is found in the module
# that uses it): torch on one thread for every test there, and the virtual clock where asked for.
@pytest.fixture(name="single_cpu_thread", autouse=True)
def single_cpu_thread_fixture():
    yield from one_thread()


@pytest.fixture(name="virtual_clock")
def virtual_clock_fixture(monkeypatch):
    yield from virtual_clock(monkeypatch)
