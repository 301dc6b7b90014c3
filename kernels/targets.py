"""Which vendor, which architecture: the compile targets the kernel knows and the device it runs on.

The one place of the kernel layer that inspects ``torch.version.hip``, device properties and
``TRITON_INTERPRET``; the harness's platform module (``parity.run.platform``) builds its
fingerprint on these answers. Torch only.
"""
from __future__ import annotations

import dataclasses
import os

import torch


@dataclasses.dataclass(frozen=True)
class ArchSpec:
    """Static facts about a compilation target (used by configs and ahead-of-time inspection)."""

    name: str  # "sm_90", "gfx942", ...
    vendor: str  # "nvidia" | "amd"
    backend: str  # Triton backend name: "cuda" | "hip"
    warp_size: int
    shared_mem_bytes: int  # per workgroup / CTA usable shared memory (LDS on AMD)
    max_warps: int
    # AMD: VGPR budget per SIMD lane, to turn a kernel's VGPR count into waves per SIMD.
    vgpr_waves: tuple[tuple[int, int], ...] = ()
    max_waves_per_simd: int = 0
    # Multiprocessors / compute units of the target's flagship part, for ahead-of-time answers
    # (the decode path's split count); at run time the device's own count is read.
    compute_units: int = 0
    # NVIDIA: per-SM limits that set how many CTAs (programs) one SM holds at once.
    sm_resources: "SmResources | None" = None

    @property
    def triton_arch(self) -> int | str:
        """The ``arch`` value of ``triton.backends.compiler.GPUTarget`` for this target."""
        if self.backend == "cuda":
            return int(self.name.removeprefix("sm_"))
        return self.name


@dataclasses.dataclass(frozen=True)
class SmResources:
    """An NVIDIA SM's resources for occupancy (CUDA C++ Programming Guide, "Compute Capabilities",
    table of technical specifications, for 8.0 and 9.0): 64 Ki 32-bit registers allocated per warp
    in units of 256, at most 64 resident warps and 32 CTAs, shared memory per SM (164 KiB on 8.0,
    228 KiB on 9.0) of which the system reserves 1 KiB per CTA."""

    registers: int = 65536
    register_unit: int = 256  # registers per warp are allocated in multiples of this
    max_warps: int = 64
    max_blocks: int = 32
    shared_bytes: int = 228 * 1024
    reserved_shared_per_block: int = 1024

    def blocks_per_sm(self, registers_per_thread: int, num_warps: int, shared_bytes: int,
                      warp_size: int = 32) -> dict[str, int]:
        """CTAs one SM holds at once, by each limit and overall (``"blocks"``)."""
        per_warp = -(-registers_per_thread * warp_size // self.register_unit) * self.register_unit
        by_regs = self.registers // (per_warp * num_warps) if registers_per_thread else self.max_blocks
        by_shared = self.shared_bytes // (shared_bytes + self.reserved_shared_per_block)
        by_warps = self.max_warps // num_warps
        return {"blocks": min(by_regs, by_shared, by_warps, self.max_blocks), "by_registers": by_regs,
                "by_shared": by_shared, "by_warps": by_warps}


# Triton's AMD backend specializes a tensor argument on whether its storage is within 2**31 - 1
# bytes ("S": 32-bit offsets, buffer loads; ``HIPBackend.get_tensor_specialization``, Triton 3.6 to
# 3.9, on while ``knobs.amd.use_buffer_ops`` is, its default); NVIDIA's does not. Read once: a
# process runs torch for one vendor. Launch keys hold it (``launch_cache.pointer_key``).
# The GPU vendor torch was built for (ROCm or CUDA), read once: every vendor test below asks it.
_TORCH_GPU_VENDOR = "amd" if torch.version.hip else "nvidia"
POINTER_RANGE_SPECIALIZED = _TORCH_GPU_VENDOR == "amd"

# gfx9 CDNA: 512 VGPRs per SIMD lane; waves per SIMD by VGPRs used (parity/NUMERICS.md; AMD CDNA3 ISA
# guide, "VGPR allocation"). gfx90a and gfx942 share the table; gfx950 too (same VGPR file).
_CDNA_VGPR_WAVES = ((64, 8), (96, 5), (128, 4), (168, 3), (256, 2), (512, 1))

ARCHS: dict[str, ArchSpec] = {
    spec.name: spec
    for spec in (
        # A100: 108 SMs; H100/H200 SXM: 132 (read on the H200); MI250X: 110 CUs per die;
        # MI300X: 304 CUs (parity/NUMERICS.md); MI355X: 256 CUs (vendors' datasheets).
        ArchSpec("sm_80", "nvidia", "cuda", 32, 163 * 1024, 32, compute_units=108,
                 sm_resources=SmResources(shared_bytes=164 * 1024)),
        ArchSpec("sm_90", "nvidia", "cuda", 32, 227 * 1024, 32, compute_units=132,
                 sm_resources=SmResources(shared_bytes=228 * 1024)),
        ArchSpec("gfx90a", "amd", "hip", 64, 64 * 1024, 16, _CDNA_VGPR_WAVES, 8, compute_units=110),
        ArchSpec("gfx942", "amd", "hip", 64, 64 * 1024, 16, _CDNA_VGPR_WAVES, 8, compute_units=304),
        ArchSpec("gfx950", "amd", "hip", 64, 160 * 1024, 16, _CDNA_VGPR_WAVES, 8, compute_units=256),
    )
}


def arch_spec(name: str) -> ArchSpec:
    """The facts of a target; ValueError naming the known ones for any other name."""
    try:
        return ARCHS[name]
    except KeyError:
        raise ValueError(f"unknown target {name!r}; known targets: {', '.join(ARCHS)}") from None


def triton_interpreter_enabled() -> bool:
    """True when Triton kernels run through the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def vendor_of(device: torch.device | str) -> str:
    """"nvidia", "amd" or "cpu" for a torch device."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    return _TORCH_GPU_VENDOR


def arch_of(device: torch.device | str) -> str:
    """Architecture name of a device: "sm_90", "gfx942", or "cpu" (Triton interpreter)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    if _TORCH_GPU_VENDOR == "amd":
        # gcnArchName looks like "gfx942:sramecc+:xnack-"
        return props.gcnArchName.split(":")[0]
    return f"sm_{props.major}{props.minor}"


def compute_units(device: torch.device | str) -> int:
    """Multiprocessors (NVIDIA) or compute units (AMD) of a GPU device; 1 for the CPU (the
    interpreter runs one program at a time)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def warp_size(device: torch.device | str) -> int:
    """Threads per warp (NVIDIA) or wavefront (AMD) of a GPU device; 32 for the CPU (the
    interpreter runs a program as one thread: any width computes the same)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 32
    size = getattr(torch.cuda.get_device_properties(device), "warp_size", None)
    if size:
        return int(size)
    arch = arch_of(device)
    return ARCHS[arch].warp_size if arch in ARCHS else (64 if vendor_of(device) == "amd" else 32)


def environment(device: torch.device | str) -> dict:
    """What a measurement ran on: the device's name and multiprocessor / compute-unit count,
    torch, its CUDA or ROCm version, Triton (the harness's fuller record is
    ``parity.run.platform.fingerprint``)."""
    import triton

    device = torch.device(device)
    name = torch.cuda.get_device_properties(device).name if device.type == "cuda" else "cpu (Triton interpreter)"
    return {"device": name, "vendor": vendor_of(device), "multiprocessors": compute_units(device),
            "torch": torch.__version__, "cuda": torch.version.cuda, "hip": torch.version.hip,
            "triton": triton.__version__}
