"""The device's clock and clock-throttling reasons during ``parity bench``'s timed rounds.

Where they come from (:func:`reader_for`):

- NVIDIA: NVML through ``pynvml`` (the ``nvidia-ml-py`` package, which ``torch.cuda.clock_rate``
  uses too), on the NVML device torch maps the CUDA device to: the SM clock
  (``nvmlDeviceGetClockInfo``) and the active clock event (throttle) reasons
  (``nvmlDeviceGetCurrentClocksEventReasons``, ``...ThrottleReasons`` on older bindings), a bit
  mask decoded by :func:`nvml_reasons`. Reasons that slow the clock down (power cap, thermal,
  hardware slowdown, power brake) count as throttling; ``GpuIdle``, the applications clocks
  setting, sync boost and the display clock setting do not.
- AMD (ROCm, where torch.cuda is HIP): ``amdsmi`` (ROCm 6+): the GFX clock and the GPU metrics'
  throttle status (``indep_throttle_status``, else ``throttle_status``); any set bit counts as
  throttling. Untested on a real device here.
- A CPU, or a GPU whose library is not installed: nothing is reported, and the report says so.

:class:`ClockWatch` samples before the timed rounds, after every round (outside the timed calls,
after a whole-device synchronisation) and after them. Its warnings: any sample with a throttling
reason; an SM/GFX clock after the rounds below 90% of the one before.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

# nvmlClocksEventReasons (nvml.h): the bits that mean the clock is held down, and those that do not.
NVML_THROTTLING = {0x4: "software power cap", 0x8: "hardware slowdown", 0x20: "software thermal slowdown",
                   0x40: "hardware thermal slowdown", 0x80: "hardware power brake slowdown"}
NVML_NOT_THROTTLING = {0x1: "GPU idle", 0x2: "applications clocks setting", 0x10: "sync boost",
                       0x100: "display clock setting"}
CLOCK_DROP = 0.9  # a clock after the rounds below this fraction of the one before is warned


@dataclasses.dataclass(frozen=True)
class Sample:
    """One reading: the SM/GFX clock in MHz (None where not read) and the throttling reasons active."""

    clock_mhz: int | None
    throttling: tuple[str, ...] = ()


def nvml_reasons(mask: int) -> tuple[str, ...]:
    """The throttling reasons of an NVML clock event reason mask, in bit order (the reasons that do
    not hold the clock down, and bits this table does not know, are left out)."""
    return tuple(NVML_THROTTLING[bit] for bit in sorted(NVML_THROTTLING) if mask & bit)


class NvmlReader:
    """The clock and throttle reasons of one CUDA device through pynvml."""

    source = "NVML (pynvml)"

    def __init__(self, device: torch.device):
        import pynvml

        self.nvml = pynvml
        self.handle = torch.cuda._get_pynvml_handler(device)  # nvmlInit, and CUDA_VISIBLE_DEVICES mapped
        self.reasons = (getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                        or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons)
        self.sample()  # fails here, not during the rounds, where the driver does not answer

    def sample(self) -> Sample:
        clock = int(self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM))
        return Sample(clock, nvml_reasons(int(self.reasons(self.handle))))


class AmdsmiReader:
    """The GFX clock and throttle status of one HIP device through amdsmi (ROCm 6+)."""

    source = "amdsmi"

    def __init__(self, device: torch.device):
        import amdsmi

        self.smi = amdsmi
        self.handle = torch.cuda._get_amdsmi_handler(device)
        self.sample()

    def sample(self) -> Sample:
        info = self.smi.amdsmi_get_clock_info(self.handle, self.smi.AmdSmiClkType.GFX)
        clock = info.get("clk") if isinstance(info, dict) else None
        metrics = self.smi.amdsmi_get_gpu_metrics_info(self.handle)
        status = metrics.get("indep_throttle_status", metrics.get("throttle_status"))
        throttled = isinstance(status, int) and not isinstance(status, bool) and status not in (0, 0xFFFFFFFF,
                                                                                               2**64 - 1)
        reasons = (f"throttle status {status:#x}",) if throttled else ()
        return Sample(int(clock) if isinstance(clock, (int, float)) else None, reasons)


def reader_for(device: torch.device) -> tuple[Any | None, str]:
    """``(reader, note)``: an object whose ``sample()`` reads the device now, or None with the
    reason nothing is reported."""
    if device.type != "cuda":
        return None, f"not reported: a {device.type.upper()} reports no clock throttling here"
    hip = bool(getattr(torch.version, "hip", None))
    library = "amdsmi" if hip else "pynvml (nvidia-ml-py)"
    try:
        reader = AmdsmiReader(device) if hip else NvmlReader(device)
    except ImportError:
        return None, f"not reported: {library} is not installed"
    except Exception as err:  # noqa: BLE001 - a driver that does not answer is reported, not fatal
        return None, f"not reported: {library} did not answer ({type(err).__name__}: {err})"
    return reader, f"read through {reader.source} before, between and after the timed rounds"


class ClockWatch:
    """Samples of the device's clock and throttling reasons over the timed rounds."""

    def __init__(self, device: torch.device, chooser: Callable[[torch.device], tuple[Any | None, str]] | None = None):
        self.reader, self.note = (chooser or reader_for)(device)
        self.samples: list[Sample] = []
        self.failed: str | None = None

    def sample(self) -> None:
        if self.reader is None or self.failed:
            return
        try:
            self.samples.append(self.reader.sample())
        except Exception as err:  # noqa: BLE001 - stop sampling, say so; the timings stand
            self.failed = f"{type(err).__name__}: {err}"

    def throttled(self) -> dict[str, int]:
        """Each throttling reason seen, with the number of samples that had it."""
        counts: dict[str, int] = {}
        for sample in self.samples:
            for reason in sample.throttling:
                counts[reason] = counts.get(reason, 0) + 1
        return counts

    def clocks(self) -> list[int]:
        return [sample.clock_mhz for sample in self.samples if sample.clock_mhz is not None]

    def warnings(self) -> list[str]:
        out = []
        throttled = self.throttled()
        if throttled:
            seen = ", ".join(f"{reason} ({count} of {len(self.samples)} samples)" for reason, count in throttled.items())
            out.append(f"the device reported clock throttling during the timed rounds: {seen}; the timings are "
                       "not those of a cool device at full clock (let it cool down, check its power and cooling)")
        clocks = self.clocks()
        if len(clocks) >= 2 and clocks[-1] < CLOCK_DROP * clocks[0]:
            out.append(f"the device clock fell from {clocks[0]} to {clocks[-1]} MHz during the timed rounds: "
                       "the timings are not comparable with a cool run")
        if self.failed:
            out.append(f"the clock stopped answering during the timed rounds ({self.failed}); throttling after that "
                       "is unknown")
        return out

    def to_dict(self) -> dict[str, Any]:
        clocks = self.clocks()
        return {"reported": self.reader is not None, "source": getattr(self.reader, "source", None),
                "note": self.note, "samples": len(self.samples),
                "clock_mhz": {"first": clocks[0] if clocks else None, "last": clocks[-1] if clocks else None,
                              "min": min(clocks) if clocks else None, "max": max(clocks) if clocks else None},
                "throttling": self.throttled(), "summary": self.summary()}

    def summary(self) -> str:
        """One line for the text and HTML reports."""
        if self.reader is None:
            return self.note
        clocks = self.clocks()
        throttled = self.throttled()
        where = f"{len(self.samples)} samples through {self.reader.source}"
        if clocks:
            where += f", clock {min(clocks)}-{max(clocks)} MHz"
        return f"{where}; " + ("THROTTLED: " + ", ".join(throttled) if throttled else "no throttling reported")


__all__ = ["AmdsmiReader", "ClockWatch", "NVML_NOT_THROTTLING", "NVML_THROTTLING", "NvmlReader", "Sample",
           "nvml_reasons", "reader_for"]
