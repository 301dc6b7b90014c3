"""The process group of a distributed run: joining it from torchrun's environment, the 1-D mesh, and agreeing.

Under ``torchrun`` (or any launcher that sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``) :func:`join` initialises the default process group, NCCL for a CUDA device (RCCL
on ROCm, which torch calls nccl) and gloo for the CPU, unless the caller's code already did; a
CUDA device becomes ``cuda:LOCAL_RANK``. Library callers inside an initialised group pass nothing.

Every rank runs the same steps; when one rank fails (a bad argument, a subject that raises), the
others must not wait for it at the next collective forever. :meth:`Group.agree` is the
checkpoint: every rank says whether it failed, and if one did, every other rank raises a
:class:`RankFailed` naming that rank and its one-line message. A rank that died (killed, out of
memory) cannot say so: the collective breaks instead, and the survivors raise a RankFailed saying
the group broke during that step (exit 2, one line), not an internal error; the launcher
(torchrun) names the rank whose process died, and the set on disk names it when opened.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import re
from typing import Any

import torch

from parity.base.errors import UsageError, classify

# Environment variables a launcher sets for every rank (torchrun, torch.multiprocessing users).
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE")


class RankFailed(UsageError):
    """Another rank of this run failed; this rank stops at the same step."""


_JOINED_HERE = False


def joined_here() -> bool:
    """Whether this process initialised a process group through :func:`join` (a rank of a launch)."""
    return _JOINED_HERE


def launched() -> bool:
    """Whether this process is one rank of a distributed launch (torchrun sets ``RANK`` and
    ``WORLD_SIZE``), or already inside an initialised process group."""
    import torch.distributed as dist

    return (dist.is_available() and dist.is_initialized()) or all(name in os.environ for name in LAUNCH_VARIABLES)


@dataclasses.dataclass
class Group:
    """This rank's place in the default process group, and its device."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    owned: bool  # initialised here (and destroyed by :meth:`close`)

    def mesh(self):
        """A 1-D device mesh over every rank (``init_device_mesh``), named ``tp``."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("tp",))

    def broken(self, err: RuntimeError, step: str) -> RankFailed:
        """The error of a collective that failed because another rank is gone (or hangs)."""
        detail = re.sub(r"^\[[^\]]*\]\s*", "", " ".join(str(err).split()))  # gloo's "[file.cc:537] " prefix
        detail = detail.split(". ")[0][:160] or type(err).__name__
        return RankFailed(f"rank {self.rank} of {self.world_size}: the process group broke during {step}: another "
                          f"rank exited or stopped answering ({self.backend}: {detail})")

    def gather(self, value: Any, *, step: str = "a gather") -> list[Any]:
        """Every rank's ``value`` (picklable, small), on every rank, in rank order."""
        import torch.distributed as dist

        values: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(values, value)
        except RuntimeError as err:  # torch.distributed's errors (DistBackendError, gloo's) are RuntimeErrors
            raise self.broken(err, step) from err
        return values

    def broadcast(self, value: Any, *, step: str = "a broadcast") -> Any:
        """Rank 0's ``value`` on every rank."""
        import torch.distributed as dist

        box = [value if self.rank == 0 else None]
        try:
            dist.broadcast_object_list(box, src=0)
        except RuntimeError as err:
            raise self.broken(err, step) from err
        return box[0]

    def barrier(self, *, step: str = "a barrier") -> None:
        import torch.distributed as dist

        try:
            dist.barrier()
        except RuntimeError as err:
            raise self.broken(err, step) from err

    def agree(self, error: BaseException | None, step: str) -> None:
        """Checkpoint after ``step``: re-raise this rank's ``error``, or raise RankFailed when another
        rank failed (the lowest such rank is named), or return when every rank succeeded. When the
        group itself broke (a rank died), that RankFailed, unless this rank has a usage error of its
        own (an error in the subject's code, a collective inside it, is then the broken group's)."""
        status = None
        if error is not None:
            code, _, message = classify(error)
            status = (code, " ".join(str(message).split()))
        try:
            statuses = self.gather(status, step=step)
        except RankFailed:
            if isinstance(error, UsageError):
                raise error from None
            raise
        if error is not None:
            raise error
        for rank, item in enumerate(statuses):
            if item is not None:
                raise RankFailed(f"rank {rank} of {self.world_size} failed during {step}: {item[1]}")

    def close(self, *, synchronize: bool = True) -> None:
        """Destroy the group if it was initialised here; ``synchronize``: first wait until every rank
        is done with it (after a success; after an error a rank may be gone)."""
        import torch.distributed as dist

        if self.owned and dist.is_initialized():
            if synchronize:
                self.barrier(step="closing the process group")
            dist.destroy_process_group()


def join(device: torch.device | str | None = None, *, timeout_s: float | None = None) -> Group:
    """This rank's :class:`Group`; initialises the default group from the environment if needed.

    ``device``: ``cpu`` or ``cuda`` (a CUDA device becomes ``cuda:LOCAL_RANK``); default cuda when
    a GPU is present. A UsageError when torch.distributed is unavailable or the launch variables
    are missing or malformed.
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise UsageError("this torch build has no torch.distributed; a distributed capture or compare needs it")
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index is None:
        local = _env_int("LOCAL_RANK", default=0)
        if local >= torch.cuda.device_count():
            raise UsageError(f"LOCAL_RANK {local} but this host has {torch.cuda.device_count()} CUDA devices")
        device = torch.device("cuda", local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    owned = False
    if not dist.is_initialized():
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise UsageError(f"a distributed run needs {name} in the environment (run it under torchrun)")
        _env_int("RANK", default=0)
        _env_int("WORLD_SIZE", default=1)
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {"backend": backend}
        if timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            kwargs["device_id"] = device
        try:
            dist.init_process_group(**kwargs)
        except (RuntimeError, ValueError) as err:  # an unreachable master, a port in use
            raise UsageError(f"cannot join the process group ({backend}): {' '.join(str(err).split())[:300]}") from None
        owned = True
        global _JOINED_HERE
        _JOINED_HERE = True
    backend = str(dist.get_backend())
    return Group(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device, backend=backend, owned=owned)


def _env_int(name: str, *, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise UsageError(f"environment variable {name}={value!r} is not an integer") from None
    if number < 0:
        raise UsageError(f"environment variable {name}={value!r} is negative")
    return number


__all__ = ["Group", "RankFailed", "join", "launched", "LAUNCH_VARIABLES"]
