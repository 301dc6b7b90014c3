"""Running a subject on this host: device checks, the Triton interpreter switch, CPU threads, progress,
launch configs.

Shared by capture and compare (and the commands in front of them); nothing here judges numbers.

Triton on the CPU. The library never changes the environment: ``impl="triton"`` on a CPU device
without ``TRITON_INTERPRET=1`` is a UsageError (:func:`check_triton_mode`). The CLI calls
:func:`enable_triton_interpreter` first, which turns the interpreter on when that is still
possible (Triton not imported yet) instead of asking the user to.
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from parity.base.errors import UsageError
from parity.run import platform


def check_device(device: torch.device | str) -> torch.device:
    """A torch.device this host can run on; UsageError for a bad or absent device."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(f"bad device {device!r}; use cpu or cuda (cuda:N)") from None
    if parsed.type not in ("cpu", "cuda"):
        raise UsageError(f"unsupported device {device!r}; use cpu or cuda (ROCm GPUs are cuda in PyTorch)")
    if parsed.type == "cuda":
        if not platform.gpu_available():
            raise UsageError(f"device {device!r} requested but no GPU is available on this host")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise UsageError(f"device {device!r} does not exist; this host has {torch.cuda.device_count()} GPU(s)")
    return parsed


@contextmanager
def cores_left_for(threads: int) -> Iterator[int]:
    """Run torch's CPU operators on fewer threads while ``threads`` background threads (the bundle
    writer's hashing and writing) need cores too; yields the thread count used, restored after.

    At most a quarter of the cores are given up, so a small machine keeps every thread: measured
    on the 16-core H200 host, a capture whose fp64 reference run used all 16 threads beside the
    writer's five took 2.15-2.36 s (20-23 CPU seconds: OpenMP threads waiting at barriers for
    cores the writer held), 1.73 s with 12 threads and 1.71 s with 8 (bench/harness/BENCHMARK.md).
    """
    before = torch.get_num_threads()
    wanted = max(1, before - min(threads, (os.cpu_count() or 1) // 4))
    if wanted != before:
        torch.set_num_threads(wanted)
    try:
        yield wanted
    finally:
        if wanted != before:
            torch.set_num_threads(before)


def check_triton_mode(impl: str, device: torch.device, *, what: str = "--impl triton on --device cpu") -> None:
    """The Triton kernel on CPU tensors needs the interpreter, chosen before Triton is imported.
    ``what`` names the run in the caller's own options (the pytest plugin's are ``--parity-impl``...)."""
    if impl == "triton" and device.type == "cpu" and not platform.triton_interpreter_enabled():
        raise UsageError(
            f"{what} needs the Triton interpreter: run with TRITON_INTERPRET=1 in the environment (it must be "
            f"set before Python starts)"
        )


def enable_triton_interpreter(impl: str, device: torch.device | str) -> bool:
    """For the CLI: turn on ``TRITON_INTERPRET`` for a run on a CPU device, if still possible.

    Triton decides between compiling and interpreting a kernel when the kernel is defined, so the
    variable only takes effect if Triton has not been imported yet; then it is set and True is
    returned. Any impl, not only ``triton``: a user subject's kernel impl (``--impl kernel`` of a
    transformers model) runs Triton too, and on CPU tensors Triton can only ever interpret. If
    Triton is already imported without it, ``impl="triton"`` raises the same UsageError as
    :func:`check_triton_mode`; other impls are left alone (False).
    """
    device = torch.device(device)
    if device.type != "cpu" or platform.triton_interpreter_enabled():
        return False
    if "triton" in sys.modules:
        check_triton_mode(impl, device)  # raises for impl "triton": too late to switch
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    return True


def launch_configs(module: torch.nn.Module) -> dict[str, Any]:
    """Launch configs that modules report after running (``parity_launch_config``), by module path."""
    used = {}
    for name, sub in module.named_modules():
        config = getattr(sub, "parity_launch_config", None)
        if config:
            used[name or "<root>"] = config
    return used


def fresh_copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy in newly allocated memory on ``device``, for feeding stored tensors to the model.

    Tensors read from a safetensors shard sit at whatever offset the file gives them (8-byte
    aligned, measured), and CPU GEMM kernels pick code paths by alignment: an fp32 Linear on such
    a tensor differed from the same values in freshly allocated memory by 2.4e-7 (max abs). A fresh
    copy makes a same-host comparison, and a replay, bitwise reproducible.
    """
    return tensor.to(device, copy=True)


class Progress:
    """Rate-limited progress lines: ``say(msg)`` always emits, ``say.tick(lambda: msg)`` at most
    every ``every_s`` seconds."""

    def __init__(self, emit: Callable[[str], None] | None, every_s: float = 2.0):
        self.emit = emit
        self.every_s = every_s
        self._last = time.monotonic()

    def __call__(self, message: str) -> None:
        if self.emit is not None:
            self.emit(message)

    def tick(self, message: Callable[[], str]) -> None:
        now = time.monotonic()
        if self.emit is not None and now - self._last >= self.every_s:
            self._last = now
            self.emit(message())

